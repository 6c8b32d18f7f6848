//! One range to many peers: the broadcast's source side (`broadcast`), its
//! bounded messages (`castmsg`) and the receivers' relay (`relay`).

pub(in crate::engine) mod broadcast;
pub(in crate::engine) mod castmsg;
pub(in crate::engine) mod relay;
#[cfg(test)]
pub(in crate::engine) mod cast_tests;
