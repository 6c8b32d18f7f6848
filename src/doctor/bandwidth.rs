//! Link bandwidth along the GPU–NIC path: the narrowest PCIe link each
//! side crosses against what the NIC can push, and NCCL's own model of it.

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::{placement, GdrLimit, GpuDev, NicDev, Pair, PciTopology, Placement};

use super::{Finding, Status};

/// One link as sysfs reports it.
struct LinkFiles {
    cur_gts: Option<f64>,
    cur_width: Option<u32>,
    max_gts: Option<f64>,
    max_width: Option<u32>,
}

fn parse_gts(text: &str) -> Option<f64> {
    let mut words = text.split_whitespace();
    let v = words.next()?.parse::<f64>().ok()?;
    (words.next()?.starts_with("GT/s") && v.is_finite() && v > 0.0 && v <= 1024.0).then_some(v)
}

fn parse_width(text: &str) -> Option<u32> {
    text.trim().parse::<u32>().ok().filter(|w| (1..=32).contains(w))
}

fn read_link_files(root: &SysRoot, dir: &str) -> LinkFiles {
    let t = |name: &str| root.read(&format!("{dir}/{name}")).ok();
    LinkFiles {
        cur_gts: t("current_link_speed").as_deref().and_then(parse_gts),
        cur_width: t("current_link_width").as_deref().and_then(parse_width),
        max_gts: t("max_link_speed").as_deref().and_then(parse_gts),
        max_width: t("max_link_width").as_deref().and_then(parse_width),
    }
}

/// Line-code efficiency: 8b/10b up to 5 GT/s, 128b/130b for 8–32 GT/s; at
/// 64 GT/s PCIe 6 uses 256-byte flits of which 236 carry TLP bytes.
fn encoding(gts: f64) -> (f64, &'static str) {
    if gts <= 5.0 {
        (0.8, "8b/10b")
    } else if gts <= 32.0 {
        (128.0 / 130.0, "128b/130b")
    } else {
        (236.0 / 256.0, "FLIT mode, 236 of 256 bytes")
    }
}

/// Usable bytes per second per direction after line encoding, in GB/s.
fn link_gbs(gts: f64, width: u32) -> f64 {
    gts * f64::from(width) * encoding(gts).0 / 8.0
}

fn gen_name(gts: f64) -> String {
    let gens = [(2.5, 1), (5.0, 2), (8.0, 3), (16.0, 4), (32.0, 5), (64.0, 6)];
    gens.iter().find(|(g, _)| (g - gts).abs() < 0.01).map_or_else(|| format!("{gts} GT/s"), |(_, n)| format!("Gen{n}"))
}

/// What NCCL's topology model counts for this link (`kvDictPciGen`, in GB/s),
/// quoted so the reader can compare our raw figure with NCCL's own estimate.
fn nccl_model_gbs(gts: f64, width: u32) -> f64 {
    let per_lane = [(2.5, 15.0), (5.0, 30.0), (8.0, 60.0), (16.0, 120.0), (32.0, 240.0), (64.0, 480.0)]
        .iter()
        .find(|(g, _)| (g - gts).abs() < 0.01)
        .map_or(60.0, |(_, v)| *v);
    f64::from(width) * per_lane / 80.0
}

/// A link with the speed and width used for the estimate.
struct UsedLink {
    who: String,
    gts: f64,
    width: u32,
}

impl UsedLink {
    fn gbs(&self) -> f64 {
        link_gbs(self.gts, self.width)
    }

    fn describe(&self) -> String {
        format!(
            "{}: {} x{} ({} GT/s, {}) = {:.1} GB/s per direction",
            self.who,
            gen_name(self.gts),
            self.width,
            self.gts,
            encoding(self.gts).1,
            self.gbs()
        )
    }
}

/// Reads the links of one side of a pair. The endpoint's own link is judged
/// against what both ends support, because a root port's `max_link_speed`
/// being higher than the device's is not a fault.
struct SideLinks {
    endpoint: Option<UsedLink>,
    /// Bridges above the endpoint's parent, bottom-up, with their index in
    /// the chain (their files describe real links; the parent's files
    /// describe the endpoint's link again).
    above: Vec<(usize, Option<UsedLink>)>,
    notes: Vec<String>,
    problems: Vec<String>,
}

fn side_links(root: &SysRoot, place: &Placement<'_>, label: &str, is_gpu: bool) -> SideLinks {
    let last = place.chain.len() - 1;
    let own = read_link_files(root, &place.dir(last));
    let parent = (last > 0).then(|| read_link_files(root, &place.dir(last - 1)));
    let mut notes = Vec::new();
    let mut problems = Vec::new();
    let cap_gts = [own.max_gts, parent.as_ref().and_then(|p| p.max_gts)].into_iter().flatten().reduce(f64::min);
    let cap_width = [own.max_width, parent.as_ref().and_then(|p| p.max_width)].into_iter().flatten().min();
    let endpoint = match (own.cur_gts, own.cur_width) {
        (Some(cur_gts), Some(cur_width)) => {
            let mut gts = cur_gts;
            if let Some(cap) = cap_gts {
                if cur_gts + 0.01 < cap {
                    if is_gpu {
                        notes.push(format!(
                            "{label} {} runs at {cur_gts} GT/s now but the link supports {cap} GT/s: GPUs lower the \
                             link speed when idle, so the estimate uses {cap} GT/s (read current_link_speed under \
                             load to confirm)",
                            place.chain[last]
                        ));
                        gts = cap;
                    } else {
                        problems.push(format!(
                            "{label} {} trained at {} although both ends support {}: a riser, slot or signal \
                             problem",
                            place.chain[last],
                            gen_name(cur_gts),
                            gen_name(cap)
                        ));
                    }
                }
            }
            if let Some(cap) = cap_width {
                if cur_width < cap {
                    problems.push(format!(
                        "{label} {} trained at x{cur_width} although both ends support x{cap}",
                        place.chain[last]
                    ));
                }
            }
            Some(UsedLink { who: format!("{} ({label}'s link)", place.chain[last]), gts, width: cur_width })
        }
        _ => None,
    };
    let above = (0..last.saturating_sub(1))
        .rev()
        .map(|i| {
            let l = read_link_files(root, &place.dir(i));
            let used = match (l.cur_gts, l.cur_width) {
                (Some(gts), Some(width)) => Some(UsedLink { who: place.chain[i].to_owned(), gts, width }),
                _ => None,
            };
            (i, used)
        })
        .collect();
    SideLinks { endpoint, above, notes, problems }
}

/// The known links among `side.above` whose chain index satisfies `pred`.
fn known(side: &SideLinks, pred: impl Fn(usize) -> bool) -> Vec<&UsedLink> {
    side.above.iter().filter(|(i, _)| pred(*i)).filter_map(|(_, l)| l.as_ref()).collect()
}

fn min_gbs<'a>(links: impl IntoIterator<Item = &'a UsedLink>) -> Option<(f64, &'a UsedLink)> {
    links.into_iter().map(|l| (l.gbs(), l)).min_by(|a, b| a.0.total_cmp(&b.0))
}

/// One bandwidth finding per placed pair.
/// What one GPU-NIC pair's links allow, per direction, in GB/s (10^9):
/// what `gpudirect bw` should measure there.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// The GPU (`GPU0 (0000:18:00.0)`) and its index in the topology.
    pub gpu: String,
    /// Its index among the machine's GPUs (PCI order).
    pub gpu_index: usize,
    /// The NIC.
    pub nic: String,
    /// The NIC's line rate.
    pub line_gbs: f64,
    /// With GPUDirect RDMA: the line rate, or the narrowest link on the
    /// direct path when that is lower.
    pub direct_gbs: f64,
    /// Staged through host memory, one way: the ceiling the links give.
    pub staged_gbs: f64,
}

/// One finding per GPU and each of its nearest NICs, with the estimate of
/// each pair whose links are all known.
pub(super) fn bandwidth_findings(root: &SysRoot, topo: &PciTopology, pairs: &[Pair], limit: &GdrLimit) -> (Vec<Finding>, Vec<Estimate>) {
    let (mut out, mut estimates) = (Vec::new(), Vec::new());
    for gpu in &topo.gpus {
        let mine: Vec<&Pair> = pairs.iter().filter(|p| p.gpu_index == gpu.index).collect();
        let Some(best) = mine.iter().map(|p| (p.nccl_level, p.level)).min() else { continue };
        for p in mine.into_iter().filter(|p| (p.nccl_level, p.level) == best) {
            if let Some(nic) = topo.nics.iter().find(|n| n.name == p.nic) {
                let mut est = None;
                out.push(bandwidth_finding(root, gpu, nic, &topo.nics, p, limit, &mut est));
                estimates.extend(est);
            }
        }
    }
    (out, estimates)
}

fn bandwidth_finding(
    root: &SysRoot,
    gpu: &GpuDev,
    nic: &NicDev,
    all_nics: &[NicDev],
    p: &Pair,
    limit: &GdrLimit,
    est: &mut Option<Estimate>,
) -> Finding {
    let head = format!("{} <-> {} ({})", gpu.label(), nic.name, p.level);
    let id = format!("bandwidth.path.gpu{}-{}", gpu.index, nic.name);
    let (Some(gp), Some(np)) = (placement(&gpu.sysfs_path), placement(&nic.sysfs_path)) else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: PCIe path unknown"));
    };
    let gs = side_links(root, &gp, &gpu.label(), true);
    let ns = side_links(root, &np, &nic.name, false);
    let Some(rate) = nic.rate_gbps() else {
        return Finding::new(
            id.clone(),
            Status::Skipped,
            format!("{head}: {} reports no port rate, so there is nothing to compare the links with", nic.name),
        );
    };
    let need = rate / 8.0;
    let mut missing = Vec::new();
    if gs.endpoint.is_none() {
        missing.push(format!("{} {}", gpu.label(), gpu.bdf));
    }
    if ns.endpoint.is_none() {
        missing.push(format!("{} {}", nic.name, nic.bdf));
    }
    for (side, place) in [(&gs, &gp), (&ns, &np)] {
        for (i, l) in &side.above {
            if l.is_none() {
                missing.push(place.chain[*i].to_owned());
            }
        }
    }
    if !missing.is_empty() {
        return Finding::new(
            id.clone(),
            Status::Skipped,
            format!(
                "{head}: link speed/width not reported for {} (typical of VMs and emulated bridges), so no \
                 bandwidth estimate",
                missing.join(", ")
            ),
        );
    }
    // Every link is known from here on.
    let (Some(g_ep), Some(n_ep)) = (gs.endpoint.as_ref(), ns.endpoint.as_ref()) else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: link unknown"));
    };
    // Chain index of the turnaround bridge when traffic stays below the root complex.
    let common = p.turnaround.as_ref().and_then(|t| gp.chain.iter().position(|c| *c == t.as_str()));
    let (gdr_links, shared): (Vec<&UsedLink>, Vec<&UsedLink>) = match common {
        Some(k) => {
            let mut v = vec![g_ep, n_ep];
            v.extend(known(&gs, |i| i > k));
            v.extend(known(&ns, |i| i > k));
            (v, known(&gs, |i| i <= k))
        }
        None => {
            let mut v = vec![g_ep, n_ep];
            v.extend(known(&gs, |_| true));
            v.extend(known(&ns, |_| true));
            (v, Vec::new())
        }
    };
    let gpu_chain: Vec<&UsedLink> = std::iter::once(g_ep).chain(known(&gs, |_| true)).collect();
    let nic_chain: Vec<&UsedLink> = std::iter::once(n_ep).chain(known(&ns, |_| true)).collect();
    let (Some((gdr_min, gdr_narrow)), Some((gpu_min, _)), Some((nic_min, _))) =
        (min_gbs(gdr_links.iter().copied()), min_gbs(gpu_chain.iter().copied()), min_gbs(nic_chain.iter().copied()))
    else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: no link to estimate"));
    };
    let shared_min = min_gbs(shared.iter().copied());
    let one_way =
        [Some(gpu_min), Some(nic_min), shared_min.map(|s| s.0)].into_iter().flatten().fold(f64::MAX, f64::min);
    let both_ways =
        [Some(gpu_min), Some(nic_min), shared_min.map(|s| s.0 / 2.0)].into_iter().flatten().fold(f64::MAX, f64::min);
    let gdr_on = limit.allows(p.nccl_level);
    *est = Some(Estimate {
        gpu: format!("{} ({})", gpu.label(), gpu.bdf),
        gpu_index: gpu.index,
        nic: nic.name.clone(),
        line_gbs: need,
        direct_gbs: gdr_min.min(need),
        staged_gbs: one_way.min(need),
    });

    let rate_text = nic.ports.iter().find_map(|p| p.rate.as_deref()).unwrap_or("rate");
    let mut evidence = vec![format!("{} {rate_text}: {rate} Gb/s = {need:.1} GB/s per direction", nic.name)];
    let mut seen = Vec::new();
    for l in gpu_chain.iter().chain(nic_chain.iter()) {
        if !seen.contains(&l.who) {
            seen.push(l.who.clone());
            evidence.push(format!("{} (NCCL's model: {:.1} GB/s)", l.describe(), nccl_model_gbs(l.gts, l.width)));
        }
    }
    evidence.extend(gs.notes.iter().cloned());
    evidence.extend(ns.problems.iter().cloned());
    evidence.extend(gs.problems.iter().cloned());
    evidence.extend(ns.notes.iter().cloned());
    // Functions of one card (a dual-port NIC) share its PCIe link.
    let slot = |bdf: &str| bdf.rsplit_once('.').map(|(s, _)| s.to_owned());
    for other in all_nics.iter().filter(|o| o.name != nic.name && slot(&o.bdf) == slot(&nic.bdf)) {
        evidence.push(format!(
            "{} ({}) is another function of the same card and shares this PCIe link",
            other.name, other.bdf
        ));
    }

    let gdr_path = match &p.turnaround {
        Some(t) => format!("GPU -> {t} -> NIC"),
        None => "GPU -> root complex -> NIC".to_owned(),
    };
    evidence.push(format!(
        "GPUDirect path ({gdr_path}): narrowest link {} {:.1} GB/s {} {:.1} GB/s needed{}",
        gdr_narrow.who,
        gdr_min,
        if gdr_min + 1e-9 >= need { ">=" } else { "<" },
        need,
        if gdr_on { "" } else { " (but NCCL keeps GDR off on this path, see topology.path)" }
    ));
    let mut host = format!(
        "host-staged path: every byte crosses PCIe twice (GPU -> host memory over {}'s links, narrowest {:.1} GB/s; \
         host memory -> NIC over {}'s links, narrowest {:.1} GB/s)",
        gpu.label(),
        gpu_min,
        nic.name,
        nic_min
    );
    if let Some((s, sl)) = shared_min {
        let verdict = |needed: f64| if needed <= s + 1e-9 { "fits" } else { "does not fit" };
        host.push_str(&format!(
            "; the uplink {} ({s:.1} GB/s per direction) carries both crossings: sending alone puts {need:.1} GB/s \
             up and {need:.1} GB/s down on it ({}), sending and receiving at once {:.1} GB/s each way ({})",
            sl.who,
            verdict(need),
            2.0 * need,
            verdict(2.0 * need)
        ));
    }
    host.push_str(&format!(
        "; ceiling {:.1} GB/s per direction one way, {:.1} GB/s when sending and receiving at once",
        one_way.min(need),
        both_ways.min(need)
    ));
    evidence.push(host);
    evidence.push(format!(
        "host memory: staging writes and reads each byte once, {:.1} GB/s of memory traffic at line rate one way, \
         {:.1} GB/s both ways, competing with everything else (not measured here)",
        2.0 * need,
        4.0 * need
    ));
    evidence.push(
        "estimates: raw link rate after line encoding only; TLP headers, flow control and payload size take roughly \
         another 10-20% (compare NCCL's model figures above); root-complex forwarding is not estimated"
            .to_owned(),
    );

    let problems: Vec<String> = gs.problems.iter().chain(ns.problems.iter()).cloned().collect();
    let gdr_buys = if common.is_some() {
        format!("GDR keeps traffic inside {} and off host memory", p.turnaround.as_deref().unwrap_or("the switch"))
    } else {
        "here GDR would cross the same links as staging, so it saves the host-memory copy and latency, not link \
         bandwidth"
            .to_owned()
    };
    let summary_tail = format!(
        "host staging tops out near {:.1} GB/s per direction when sending and receiving at once; {gdr_buys}",
        both_ways.min(need)
    );
    let mut f = if gdr_min + 1e-9 < need {
        Finding::new(
            id.clone(),
            Status::Warn,
            format!(
                "{head}: NIC {rate} Gb/s = {need:.1} GB/s per direction, but the narrowest link on the GPUDirect \
                 path ({}) carries only {gdr_min:.1} GB/s: not even GDR can run the NIC at line rate",
                gdr_narrow.who
            ),
        )
        .fix(if problems.is_empty() {
            format!(
                "Move the NIC or GPU to a faster slot (a {} x{} link is needed for {rate} Gb/s), or expect at most \
                 {gdr_min:.1} GB/s.",
                gen_name(gdr_narrow.gts),
                gdr_narrow.width
            )
        } else {
            format!(
                "Fix the degraded link ({}): reseat the card, try another slot or riser, check the BIOS slot \
                 bifurcation and `lspci -vv` LnkSta.",
                problems.join("; ")
            )
        })
    } else if !problems.is_empty() {
        Finding::new(
            id.clone(),
            Status::Warn,
            format!("{head}: a link runs below what both ends support ({})", problems.join("; ")),
        )
        .fix("Reseat the card, try another slot or riser, check the BIOS slot bifurcation and `lspci -vv` LnkSta.")
    } else {
        Finding::new(
            id.clone(),
            Status::Ok,
            format!(
                "{head}: NIC {rate} Gb/s = {need:.1} GB/s per direction; narrowest link on the GPUDirect path {} x{} \
                 = {gdr_min:.1} GB/s, enough for line rate; {summary_tail}",
                gen_name(gdr_narrow.gts),
                gdr_narrow.width
            ),
        )
    };
    for e in evidence {
        f = f.evidence(e);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use testkit::Rng;

    #[test]
    fn sysfs_value_parsers() {
        assert_eq!(parse_gts("16.0 GT/s PCIe"), Some(16.0));
        assert_eq!(parse_gts("8 GT/s"), Some(8.0));
        assert_eq!(parse_gts("2.5 GT/s PCIe"), Some(2.5));
        assert_eq!(parse_gts("Unknown"), None);
        assert_eq!(parse_gts("Unknown speed"), None);
        assert_eq!(parse_width("16"), Some(16));
        assert_eq!(parse_width("0"), None);
        assert!((link_gbs(16.0, 16) - 31.5077).abs() < 1e-3);
        assert!((link_gbs(5.0, 8) - 4.0).abs() < 1e-9);
        assert!((link_gbs(32.0, 16) - 63.0154).abs() < 1e-3);
    }

    #[test]
    fn garbage_text_never_panics_the_parsers() {
        let mut rng = Rng(7);
        let alphabet: Vec<char> = "0123456789.x-+ GT/sPCIeGb/sec()NDRXunknown\n\t\u{e9}\u{1f600}".chars().collect();
        let mut parsed = 0;
        for _ in 0..5000 {
            // Half random strings, half real values with a few characters replaced.
            let mut t: Vec<char> = if rng.index(2) == 0 {
                (0..rng.index(24)).map(|_| alphabet[rng.index(alphabet.len())]).collect()
            } else {
                let seeds = ["16.0 GT/s PCIe", "8 GT/s", "400 Gb/sec (4X NDR)", "0x10de", "0000:3a:00.0", "PXB", "16"];
                seeds[rng.index(seeds.len())].chars().collect()
            };
            for _ in 0..rng.index(3) {
                if !t.is_empty() {
                    let at = rng.index(t.len());
                    t[at] = alphabet[rng.index(alphabet.len())];
                }
            }
            let t: String = t.into_iter().collect();
            // The library's sysfs parsers have their own exhaustive test (gpudirect::topology).
            parsed += usize::from(parse_gts(&t).is_some());
            let _ = (parse_width(&t), gpudirect::nccl::gdr_level(&t), placement(&t));
            if let Some(g) = parse_gts(&t) {
                assert!(link_gbs(g, 16).is_finite());
            }
        }
        assert!(parsed > 0, "the fuzz never produced a parsable value");
    }
}
