//! What the machine offers that some variables are judged against: its
//! RDMA devices, the NCCL network plugins its library directories hold,
//! whether dma-buf is the only registration path. Unknown (`None`, false)
//! where the variables are judged without the machine (an NCCL log).

use gpudirect::sysroot::SysRoot;

/// What the machine offers, for the variables' judgement.
#[derive(Clone, Debug, Default)]
pub struct Site {
    /// The RDMA devices seen, when the machine was probed.
    pub rdma_devices: Option<Vec<String>>,
    /// The NCCL network plugin libraries found, when looked for.
    pub net_libs: Option<LibSearch>,
    /// Every usable GPU-NIC pair registers through dma-buf only (no peer
    /// memory): turning dma-buf off turns GPUDirect RDMA off.
    pub dma_buf_only: bool,
}

/// The library directories read and the plugin libraries found in them.
#[derive(Clone, Debug, Default)]
pub struct LibSearch {
    /// The directories read, in the dynamic linker's order.
    pub dirs: Vec<String>,
    /// The plugin libraries NCCL would try that were found, as paths.
    pub found: Vec<String>,
}

impl LibSearch {
    /// The library `name` (a file name, or a path) as the dynamic linker
    /// would find it here.
    pub fn find(&self, name: &str) -> Option<&str> {
        if name.contains('/') {
            return self.found.iter().find(|f| *f == name).map(String::as_str);
        }
        self.found.iter().find(|f| f.rsplit('/').next() == Some(name)).map(String::as_str)
    }
}

/// The directories an NCCL network plugin is looked for in, most of
/// them the dynamic linker's defaults and the plugins' install places.
const LIB_DIRS: [&str; 14] = [
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/usr/local/lib",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/aws-ofi-nccl/lib",
    "/usr/local/gib/lib64",
    "/opt/hpcx/nccl_rdma_sharp_plugin/lib",
    "/usr/local/nvidia/lib64",
];

/// The most directories read (a hostile `ld.so.conf.d` cannot make the
/// search unbounded).
const MAX_DIRS: usize = 64;

/// Looks under `root` for the NCCL network plugin libraries `names` (as
/// [`plugin_names`] gives them; a name with a `/` is a path): in
/// `library_path` (the job's `LD_LIBRARY_PATH`) first, then
/// `/etc/ld.so.conf.d`'s directories, then the defaults. Only those names
/// are looked up, never whole directories listed (a capture then holds a
/// few entries, not every library of the machine). `None` when no
/// directory could be read (a capture that did not record them): the
/// plugins are then unknown, not absent.
pub fn find_net_libs(root: &SysRoot, library_path: Option<&str>, names: &[String]) -> Option<LibSearch> {
    let mut dirs: Vec<String> = library_path.unwrap_or_default().split(':').filter(|d| d.starts_with('/')).map(str::to_owned).collect();
    if let Ok(confs) = root.list_dir("/etc/ld.so.conf.d") {
        for c in confs.iter().filter(|c| c.ends_with(".conf")).take(MAX_DIRS) {
            if let Ok(text) = root.read(&format!("/etc/ld.so.conf.d/{c}")) {
                dirs.extend(text.lines().map(str::trim).filter(|l| l.starts_with('/')).map(str::to_owned));
            }
        }
    }
    dirs.extend(LIB_DIRS.iter().map(|d| (*d).to_owned()));
    let (mut seen, mut read, mut found) = (Vec::new(), Vec::new(), Vec::new());
    for d in dirs {
        let d = d.trim_end_matches('/').to_owned();
        if seen.contains(&d) || seen.len() >= MAX_DIRS {
            continue;
        }
        if root.is_dir(&d) {
            for n in names.iter().filter(|n| !n.contains('/')) {
                let path = format!("{d}/{n}");
                if root.exists(&path) && !found.contains(&path) {
                    found.push(path);
                }
            }
            read.push(d.clone());
        }
        seen.push(d);
    }
    for n in names.iter().filter(|n| n.starts_with('/')) {
        if root.exists(n) {
            found.push(n.clone());
        }
    }
    (!read.is_empty()).then_some(LibSearch { dirs: read, found })
}

/// The libraries NCCL tries for `NCCL_NET_PLUGIN=value` (unset: `None`),
/// in its order: the value as given, then `libnccl-net-VALUE.so` unless
/// the value is a path or a full `lib*.so` name; `libnccl-net.so` when
/// unset. Empty for `none`, which loads no plugin.
pub fn plugin_names(value: Option<&str>) -> Vec<String> {
    match value.map(str::trim) {
        None | Some("") => vec!["libnccl-net.so".to_owned()],
        Some(v) if v.eq_ignore_ascii_case("none") => Vec::new(),
        Some(v) => {
            let mut out = vec![v.to_owned()];
            let full_name = v.contains('/') || (v.starts_with("lib") && v.ends_with(".so"));
            if !full_name {
                out.push(format!("libnccl-net-{v}.so"));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the files NCCL would load are looked up, in the job's
    /// LD_LIBRARY_PATH, ld.so.conf.d's directories and the defaults; a
    /// tree with none of those directories knows nothing.
    #[test]
    fn plugins_are_looked_up_by_the_names_nccl_tries() {
        let t = testkit::Tree::new("netlibs");
        t.file("/usr/lib/x86_64-linux-gnu/libnccl-net.so", "");
        t.file("/opt/p/lib/libnccl-net-ofi.so", "");
        t.file("/etc/ld.so.conf.d/x.conf", "# comment\n/srv/libs\n");
        t.file("/srv/libs/libnccl-net-gib.so", "");
        t.file("/abs/libX.so", "");
        let root = SysRoot::at(t.path());
        let got = |lp: Option<&str>, plugin: Option<&str>| find_net_libs(&root, lp, &plugin_names(plugin)).unwrap().found;
        assert_eq!(got(None, None), ["/usr/lib/x86_64-linux-gnu/libnccl-net.so"]);
        assert!(got(None, Some("ofi")).is_empty(), "/opt/p/lib is not searched without LD_LIBRARY_PATH");
        assert_eq!(got(Some("/opt/p/lib:relative"), Some("ofi")), ["/opt/p/lib/libnccl-net-ofi.so"]);
        assert_eq!(got(None, Some("gib")), ["/srv/libs/libnccl-net-gib.so"]);
        assert_eq!(got(None, Some("/abs/libX.so")), ["/abs/libX.so"]);
        assert!(got(None, Some("none")).is_empty());
        let bare = testkit::Tree::new("netlibs-bare");
        bare.file("/proc/cmdline", "");
        assert!(find_net_libs(&SysRoot::at(bare.path()), None, &plugin_names(None)).is_none());
    }
}
