//! The environment, read once at `init` into typed settings: the policy
//! (`GPUDIRECT_NCCL_GDR`) and the NCCL variables NCCL's own IB transport
//! reads for the same purposes, so a job configured for NCCL's IB
//! transport keeps its meaning. A value that cannot be read is an error
//! naming it, never a silent default.

use std::net::SocketAddr;

use gpudirect::metrics::{metrics_addr_from, METRICS_ENV};
use gpudirect::nccl::{param_int, Int, NicList};

use crate::error::{NetError, Result};

/// What happens to a GPU's traffic that NCCL would stage through host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdrPolicy {
    /// Refuse the connection before its first byte (the default).
    Require,
    /// Let it run, with one WARN line naming the pair and the cause.
    Prefer,
    /// Let it run; the path line at INFO level still says what happened.
    Off,
}

impl GdrPolicy {
    /// The variable's name.
    pub const VAR: &'static str = "GPUDIRECT_NCCL_GDR";

    /// Reads the variable's value (`None`: unset, the default `require`).
    ///
    /// # Errors
    /// [`NetError::Config`] for any other value.
    pub fn parse(value: Option<&str>) -> Result<GdrPolicy> {
        match value.map(str::trim) {
            None | Some("") => Ok(GdrPolicy::Require),
            Some(v) if v.eq_ignore_ascii_case("require") => Ok(GdrPolicy::Require),
            Some(v) if v.eq_ignore_ascii_case("prefer") => Ok(GdrPolicy::Prefer),
            Some(v) if v.eq_ignore_ascii_case("off") => Ok(GdrPolicy::Off),
            Some(v) => Err(NetError::Config(format!("{}={v:?} is not a policy: write require (the default), prefer or off", Self::VAR))),
        }
    }

    /// The name as written in the variable.
    pub fn name(self) -> &'static str {
        match self {
            GdrPolicy::Require => "require",
            GdrPolicy::Prefer => "prefer",
            GdrPolicy::Off => "off",
        }
    }
}

/// How the keys a peer gets are made: `GPUDIRECT_NCCL_KEYS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeysChoice {
    /// A type-2 memory window per receive where the device has them (the
    /// default), otherwise the comm's registrations.
    Windows,
    /// The comm's registrations, even where the device has windows.
    PerComm,
}

impl KeysChoice {
    /// The variable that sets it.
    pub const VAR: &'static str = "GPUDIRECT_NCCL_KEYS";

    /// Reads the variable's value.
    ///
    /// # Errors
    /// [`NetError::Config`] for anything but `windows` or `per-comm`.
    pub fn parse(value: Option<&str>) -> Result<KeysChoice> {
        match value.map(str::trim) {
            None | Some("") => Ok(KeysChoice::Windows),
            Some(v) if v.eq_ignore_ascii_case("windows") => Ok(KeysChoice::Windows),
            Some(v) if v.eq_ignore_ascii_case("per-comm") => Ok(KeysChoice::PerComm),
            Some(v) => Err(NetError::Config(format!("{}={v:?} is not a key mode: write windows (the default) or per-comm", Self::VAR))),
        }
    }
}

/// Everything the plugin reads from the environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// `GPUDIRECT_NCCL_GDR`.
    pub policy: GdrPolicy,
    /// `GPUDIRECT_NCCL_KEYS`.
    pub keys: KeysChoice,
    /// `NCCL_IB_HCA`, as written and as read.
    pub hca: Option<(String, NicList)>,
    /// `NCCL_IB_GID_INDEX` (unset or negative: chosen as the library chooses).
    pub gid_index: Option<u32>,
    /// `NCCL_IB_TC`, when set (overridden per comm by a v10+ traffic class).
    pub traffic_class: Option<u8>,
    /// `NCCL_IB_SL`.
    pub service_level: Option<u8>,
    /// `NCCL_IB_TIMEOUT` (the exponent of the ACK timeout, 4.096 us x 2^n).
    pub timeout: Option<u8>,
    /// `NCCL_IB_RETRY_CNT`.
    pub retry_cnt: Option<u8>,
    /// The `NCCL_*` variables, for the judgements that read them as NCCL
    /// does (`NCCL_NET_GDR_LEVEL`, `NCCL_NET_GDR_READ`).
    pub nccl_env: Vec<(String, String)>,
    /// `GPUDIRECT_METRICS`: where to serve the plugin's metrics (`None`:
    /// nowhere, the default).
    pub metrics: Option<SocketAddr>,
}

impl Config {
    /// Reads the process environment.
    ///
    /// # Errors
    /// [`NetError::Config`] naming the first value that cannot be used.
    pub fn from_process() -> Result<Config> {
        Self::from_vars(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))))
    }

    /// Reads variables given as pairs (tests, or a recorded environment).
    ///
    /// # Errors
    /// As [`from_process`](Self::from_process).
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Config> {
        let vars: Vec<(String, String)> = vars.into_iter().collect();
        let get = |name: &str| vars.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
        let int = |name: &str, max: i64| -> Result<Option<i64>> {
            let Some(v) = get(name) else { return Ok(None) };
            match param_int(v) {
                Int::Empty => Ok(None),
                Int::Number(n) if n < 0 => Ok(None),
                Int::Number(n) if n <= max => Ok(Some(n)),
                Int::Number(n) => Err(NetError::Config(format!("{name}={v:?} reads as {n}, above its maximum {max}"))),
                // NCCL would read a value without digits as 0, and one out
                // of range as its default: neither is what was meant.
                Int::NotANumber | Int::Overflow => Err(NetError::Config(format!("{name}={v:?} is not a number: write a decimal (or 0x hex) integer"))),
            }
        };
        Ok(Config {
            policy: GdrPolicy::parse(get(GdrPolicy::VAR))?,
            keys: KeysChoice::parse(get(KeysChoice::VAR))?,
            hca: get("NCCL_IB_HCA").filter(|v| !v.trim().is_empty()).map(|v| (v.to_owned(), NicList::parse(v))),
            gid_index: int("NCCL_IB_GID_INDEX", 255)?.map(|n| n as u32),
            traffic_class: int("NCCL_IB_TC", 255)?.map(|n| n as u8),
            service_level: int("NCCL_IB_SL", 15)?.map(|n| n as u8),
            timeout: int("NCCL_IB_TIMEOUT", 31)?.map(|n| n as u8),
            retry_cnt: int("NCCL_IB_RETRY_CNT", 7)?.map(|n| n as u8),
            metrics: metrics_addr_from(get(METRICS_ENV)).map_err(NetError::Config)?,
            nccl_env: vars.into_iter().filter(|(k, _)| k.starts_with("NCCL_")).collect(),
        })
    }

    /// Whether `NCCL_IB_HCA` lets the plugin use port `port` of `device`.
    pub fn selects(&self, device: &str, port: u8) -> bool {
        self.hca.as_ref().is_none_or(|(_, l)| l.selects(device, u32::from(port)))
    }

    /// The raw value of an `NCCL_*` variable.
    pub fn nccl(&self, name: &str) -> Option<&str> {
        self.nccl_env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_policy_is_require_unless_told_and_a_typo_is_refused() {
        assert_eq!(GdrPolicy::parse(None).unwrap(), GdrPolicy::Require);
        assert_eq!(GdrPolicy::parse(Some("Prefer")).unwrap(), GdrPolicy::Prefer);
        assert_eq!(GdrPolicy::parse(Some(" off ")).unwrap(), GdrPolicy::Off);
        assert_eq!(KeysChoice::parse(Some(" Per-Comm")).unwrap(), KeysChoice::PerComm);
        assert_eq!(KeysChoice::parse(None).unwrap(), KeysChoice::Windows);
        assert!(KeysChoice::parse(Some("none")).unwrap_err().to_string().contains("windows (the default) or per-comm"));
        let e = GdrPolicy::parse(Some("preferred")).unwrap_err().to_string();
        assert!(e.contains("GPUDIRECT_NCCL_GDR=\"preferred\"") && e.contains("require (the default), prefer or off"), "{e}");
    }

    #[test]
    fn nccl_variables_read_as_nccl_reads_them() {
        let c = Config::from_vars(vars(&[("NCCL_IB_HCA", "^=mlx5_1"), ("NCCL_IB_GID_INDEX", "3"), ("NCCL_IB_TC", "0x68"), ("NCCL_IB_SL", "")]))
            .unwrap();
        assert!(c.selects("mlx5_0", 1) && !c.selects("mlx5_1", 1));
        assert_eq!((c.gid_index, c.traffic_class, c.service_level), (Some(3), Some(104), None));
        assert_eq!(Config::from_vars(vars(&[("NCCL_IB_GID_INDEX", "-1")])).unwrap().gid_index, None, "-1 is NCCL's 'choose'");
        let e = Config::from_vars(vars(&[("NCCL_IB_TC", "300")])).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_TC=\"300\" reads as 300, above its maximum 255"), "{e}");
        assert!(Config::from_vars(vars(&[("NCCL_IB_SL", "high")])).is_err());
        assert_eq!(Config::from_vars(vars(&[("NCCL_NET_GDR_LEVEL", "SYS"), ("HOME", "/")])).unwrap().nccl_env.len(), 1);
    }

    /// Attack (review): `GPUDIRECT_METRICS` values. A port alone is served
    /// on loopback only (never off-host by default); spaces around are
    /// the user's, spaces inside, a sign, a hostname, a port past 65535
    /// are refused naming the variable; an explicit IP (v4 or v6) is taken.
    #[test]
    fn metrics_values_taken_and_refused() {
        use std::net::SocketAddr;
        let m = |v: &str| Config::from_vars(vars(&[("GPUDIRECT_METRICS", v)])).map(|c| c.metrics);
        assert_eq!(m("9400").unwrap(), Some(SocketAddr::from(([127, 0, 0, 1], 9400))));
        assert_eq!(m(" 9400\n").unwrap(), Some(SocketAddr::from(([127, 0, 0, 1], 9400))));
        assert_eq!(m("").unwrap(), None);
        assert_eq!(m("   ").unwrap(), None);
        assert_eq!(Config::from_vars(vars(&[])).unwrap().metrics, None);
        assert_eq!(m("[::1]:9400").unwrap(), Some("[::1]:9400".parse().unwrap()));
        assert!(m("[::1]:9400").unwrap().unwrap().ip().is_loopback());
        for bad in ["94 00", "+9400", "-9400", "localhost:9400", "host.example:9400", "65536", "99999999999999999999", "::1:9400", "127.0.0.1", "127.0.0.1:", ":9400", "0x2000", "9400,9401", "127.0.0.1:9400 0.0.0.0:9401"] {
            let e = m(bad).expect_err(bad).to_string();
            assert!(e.contains("GPUDIRECT_METRICS"), "{bad:?}: {e}");
        }
        // The last setting wins, as for every other variable here.
        assert_eq!(Config::from_vars(vars(&[("GPUDIRECT_METRICS", "junk"), ("GPUDIRECT_METRICS", "9401")])).unwrap().metrics, Some(SocketAddr::from(([127, 0, 0, 1], 9401))));
    }

    /// Attack (review, input cost / output carrying input): a huge
    /// `GPUDIRECT_METRICS` is refused with a message of bounded length
    /// (it goes into NCCL's log as init's error), not the whole value.
    #[test]
    fn a_huge_metrics_value_is_not_echoed_whole() {
        let huge = "9".repeat(1 << 20);
        let e = Config::from_vars(vars(&[("GPUDIRECT_METRICS", &huge)])).unwrap_err().to_string();
        assert!(e.len() < 1024, "the refusal of a 1 MiB value is {} bytes long", e.len());
    }
}
