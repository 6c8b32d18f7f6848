//! The rules by which NCCL, in a job's environment, does not use
//! GPUDirect RDMA on a GPU–NIC pair the machine allows: the library's one
//! table ([`gpudirect::nccl::stops`]), which the NCCL plugin and
//! `nccl-log` judge by too, given what the doctor sees of the machine
//! (whether the network plugin `NCCL_NET` needs is installed). The
//! verdict, each GPU's NIC finding and the per-variable findings' status
//! for these variables all come from here.

use gpudirect::RegistrationPath;

pub use gpudirect::nccl::{dmabuf_disabled, plugin_network, transport_off, Stop, DECIDING};

use super::{plugin_names, var, PairInEnv, Site};

/// Why NCCL, run with the environment `vars`, will not use GPUDirect RDMA
/// for `pair` although the machine allows it; `None` when the environment
/// leaves it on. The first rule that stops it, in NCCL's order, for both
/// directions. The last assignment of a name wins.
pub fn nccl_stops(vars: &[(String, String)], pair: &PairInEnv<'_>) -> Option<Stop> {
    let tried = var(vars, "NCCL_NET").and_then(|net| match plugin_missing_for(net, var(vars, "NCCL_NET_PLUGIN"), pair.site) {
        Some(Stop::PluginMissing { tried, .. }) => Some(tried),
        _ => None,
    });
    let p = gpudirect::nccl::Pair {
        nic: Some(pair.nic),
        level: pair.nccl_level,
        shown: pair.level,
        dma_buf_only: pair.dma_buf_only,
        plugin_missing: tried.as_deref(),
        sends: true,
    };
    gpudirect::nccl::stops(vars, &p)
}

/// `NCCL_NET=net` names a network only a plugin provides and the plugin
/// library NCCL would load (`NCCL_NET_PLUGIN=plugin`) is not on `site`
/// (NCCL then fails "to initialize any NET plugin"; it does not fall
/// back). `None` when the plugins were not looked for.
pub(super) fn plugin_missing_for(net: &str, plugin: Option<&str>, site: &Site) -> Option<Stop> {
    if !plugin_network(net) {
        return None;
    }
    let libs = site.net_libs.as_ref()?;
    let names = plugin_names(plugin);
    if names.iter().any(|n| libs.find(n).is_some()) {
        return None;
    }
    let tried = if names.is_empty() { "no plugin (NCCL_NET_PLUGIN=none)".to_owned() } else { names.join(" or ") };
    Some(Stop::PluginMissing { net: net.to_owned(), tried })
}

/// The path NCCL registers a pair's GPU memory by, in `vars`: the
/// library's first (`path`), except that with dma-buf turned off NCCL
/// uses peer memory where that is possible too (`dma_buf_only` false).
pub fn registration_path(vars: &[(String, String)], path: RegistrationPath, dma_buf_only: bool) -> RegistrationPath {
    match path {
        RegistrationPath::DmaBuf if dmabuf_disabled(vars).is_some() && !dma_buf_only => RegistrationPath::PeerMemory,
        p => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The first rule in NCCL's order decides; each is typed; the deciding
    /// variables are the rules' own.
    #[test]
    fn the_first_rule_in_ncclss_order_decides() {
        let site = Site::default();
        let pix = Some(gpudirect::topology::PathLevel::Pix);
        let pair = PairInEnv { nic: "mlx5_0", level: pix, nccl_level: pix, dma_buf_only: true, site: &site };
        let both = vars(&[("NCCL_IB_HCA", "mlx5_1"), ("NCCL_NET", "Socket")]);
        assert_eq!(nccl_stops(&both, &pair), Some(Stop::Sockets { value: "Socket".into() }));
        assert_eq!(nccl_stops(&vars(&[("NCCL_IB_HCA", "mlx5_1")]), &pair), Some(Stop::HcaLeavesOut { value: "mlx5_1".into(), nic: "mlx5_0".into() }));
        assert_eq!(nccl_stops(&vars(&[("NCCL_DMABUF_ENABLE", "0")]), &pair), Some(Stop::DmabufOff { value: "0".into() }));
        assert!(matches!(nccl_stops(&vars(&[("NCCL_NET_GDR_LEVEL", "LOC")]), &pair), Some(Stop::LevelBelowPath { .. })));
        assert_eq!(nccl_stops(&vars(&[("NCCL_IB_DISABLE", "yes")]), &pair), None, "strtoll reads yes as 0");
        assert_eq!(DECIDING, ["NCCL_NET", "NCCL_IB_DISABLE", "NCCL_NET_PLUGIN", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE", "NCCL_NET_GDR_READ"]);
        assert_eq!(nccl_stops(&vars(&[("NCCL_NET_GDR_READ", "0")]), &pair), Some(Stop::GdrReadOff { value: "0".into() }), "sends from host memory");
    }

    /// With dma-buf off NCCL registers by peer memory where it can; where
    /// dma-buf is the only path, the path stays and the rule stops it.
    #[test]
    fn dma_buf_off_moves_ncclss_path_to_peer_memory_where_it_can() {
        let off = vars(&[("NCCL_DMABUF_ENABLE", "0")]);
        assert_eq!(registration_path(&off, RegistrationPath::DmaBuf, false), RegistrationPath::PeerMemory);
        assert_eq!(registration_path(&off, RegistrationPath::DmaBuf, true), RegistrationPath::DmaBuf);
        assert_eq!(registration_path(&[], RegistrationPath::DmaBuf, false), RegistrationPath::DmaBuf);
    }
}
