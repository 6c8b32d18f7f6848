//! One range to many peers: the broadcast's source side (`broadcast`) and
//! the receivers' relay (`relay`); their messages are `wire::castmsg`.

pub(crate) mod broadcast;
pub(crate) mod relay;
#[cfg(test)]
pub(crate) mod cast_tests;
