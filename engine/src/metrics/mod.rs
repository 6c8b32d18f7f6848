//! What an agent did, as one typed snapshot ([`AgentStats`]), its
//! Prometheus text exposition, and the opt-in HTTP endpoint that serves
//! it from its own threads (`AgentConfig::metrics`).

pub(crate) mod snapshot;
pub(crate) mod text;
