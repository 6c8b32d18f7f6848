//! One range to many peers: the broadcast's source side (`broadcast`), its
//! bounded messages (`castmsg`) and the receivers' relay (`relay`).

pub(in crate) mod broadcast;
pub(in crate) mod castmsg;
pub(in crate) mod relay;
#[cfg(test)]
pub(in crate) mod cast_tests;
