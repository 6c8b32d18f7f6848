//! A misbehaving remote: wrong keys, bounds and permissions, and memory
//! deregistered under a peer, each a typed error on the initiator.

use super::*;

/// B's regions: (name, access). `gone` is deregistered right after its
/// description is sent; `fresh` is registered after that, likely reusing
/// its slot, and must not be reachable through the old key.
const REGIONS: [(&str, AccessFlags); 5] = [
    ("rw", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
    ("ro", AccessFlags::REMOTE_READ),
    ("wo", AccessFlags::REMOTE_WRITE),
    ("gone", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
    ("fresh", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
];
const MISUSE_LEN: usize = 64 * 1024;

#[derive(Clone, Copy)]
enum Misuse {
    WrongRkey,
    PastTheEnd,
    WriteToReadOnly,
    ReadFromWriteOnly,
    WriteAfterDereg,
    ReadAfterDereg,
}

const MISUSES: [(&str, Misuse); 6] = [
    ("write with a wrong rkey", Misuse::WrongRkey),
    ("write past the end of the region (the peer lied about its length)", Misuse::PastTheEnd),
    ("write to a region without REMOTE_WRITE", Misuse::WriteToReadOnly),
    ("read from a region without REMOTE_READ", Misuse::ReadFromWriteOnly),
    ("write after the peer deregistered the region", Misuse::WriteAfterDereg),
    ("read after the peer deregistered the region", Misuse::ReadAfterDereg),
];

pub(super) fn remote_misuse(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    let h = Host::open()?;
    let cfg = QpConfig::default();
    match role {
        Role::A => misuse_initiator(&h, &cfg, &mut ctl),
        Role::B => misuse_target(&h, &cfg, &mut ctl),
    }
}

fn misuse_initiator(h: &Host, cfg: &QpConfig, ctl: &mut OobChannel) -> R<()> {
    let src = MemoryRegion::alloc(&h.pd, 2 * MISUSE_LEN, AccessFlags::default())?;
    src.write_at(0, &pattern(2 * MISUSE_LEN, 42))?;
    let dst = MemoryRegion::alloc(&h.pd, 2 * MISUSE_LEN, AccessFlags::LOCAL_WRITE)?;
    let mut bufs = Vec::new();
    for (case, misuse) in MISUSES {
        step(ctl, case)?;
        let (qp, b) = h.connect(ctl, cfg, vec![])?;
        if bufs.is_empty() {
            bufs = b;
        }
        ensure!(bufs.len() == 4, "target described {} regions, expected rw ro wo gone", bufs.len());
        let (rw, ro, wo, gone) = (bufs[0], bufs[1], bufs[2], bufs[3]);
        let wr = match misuse {
            Misuse::WrongRkey => SendWr::write(src.slice(..4096)?, &RemoteBuffer { rkey: rw.rkey ^ 0x5a_5a00, ..rw }, 0)?,
            Misuse::PastTheEnd => {
                let liar = RemoteBuffer { len: rw.len * 2, ..rw };
                SendWr::write(src.slice(..8192)?, &liar, rw.len - 4096)?
            }
            Misuse::WriteToReadOnly => SendWr::write(src.slice(..4096)?, &ro, 0)?,
            Misuse::ReadFromWriteOnly => SendWr::read(dst.slice(..4096)?, &wo, 0)?,
            Misuse::WriteAfterDereg => SendWr::write(src.slice(..4096)?, &gone, 0)?,
            Misuse::ReadAfterDereg => SendWr::read(dst.slice(..4096)?, &gone, 0)?,
        };
        qp.post_send(&[wr.wr_id(1)])?;
        let mut wc = [WorkCompletion::default(); 1];
        h.wait(&mut wc)?;
        let state = qp.state()?;
        let local_untouched = dst.to_vec()?.iter().all(|&b| b == 0);
        let peer = ask(ctl, "completed")?;
        figure(json!({
            "scenario": "remote-misuse", "case": case, "initiator_status": wc[0].status.verbs_name(),
            "initiator_qp": format!("{state:?}"), "target_qp": peer["qp_state"],
            "target_memory_untouched": peer["untouched"], "recovery": "rebuild both queue pairs",
        }));
        ensure!(wc[0].status == WcStatus::RemoteAccessError, "{case}: got {}, expected IBV_WC_REM_ACCESS_ERR", wc[0].status);
        ensure!(state == QpState::Error, "{case}: initiator queue pair is {state:?}, expected Error");
        ensure!(peer["untouched"] == true, "{case}: the target's memory changed: {peer}");
        ensure!(local_untouched, "{case}: the failed read wrote local memory");
    }

    // The library's own bounds check refuses before posting; the queue
    // pair stays usable, so the same queue pair then does a valid write.
    step(ctl, "bounds check, then valid traffic")?;
    let (qp, _) = h.connect(ctl, cfg, vec![])?;
    let rw = bufs[0];
    let refused = SendWr::write(src.slice(..4096)?, &rw, rw.len - 100);
    ensure!(matches!(refused, Err(Error::OutOfBounds { .. })), "an out-of-bounds write was not refused locally");
    ensure!(qp.state()? == QpState::Rts, "the queue pair left RTS after a local refusal");
    let one = MemoryRegion::alloc(&h.pd, MISUSE_LEN, AccessFlags::default())?;
    let back = MemoryRegion::alloc(&h.pd, MISUSE_LEN, AccessFlags::LOCAL_WRITE)?;
    one.write_at(0, &pattern(MISUSE_LEN, 77))?;
    stream(h, &qp, true, &one, &rw, 1, CHUNK)?;
    stream(h, &qp, false, &back, &rw, 1, CHUNK)?;
    ensure!(back.to_vec()? == pattern(MISUSE_LEN, 77), "valid traffic after the rebuilds read back wrong data");
    let peer = ask(ctl, "valid traffic done")?;
    figure(json!({ "scenario": "remote-misuse", "case": "local bounds check, then valid traffic on the same queue pair",
                   "refused_locally": true, "qp_state_after_refusal": "Rts", "target": peer }));
    ensure!(peer["rw_written"] == true && peer["others_untouched"] == true, "target after valid traffic: {peer}");
    Ok(())
}

fn misuse_target(h: &Host, cfg: &QpConfig, ctl: &mut OobChannel) -> R<()> {
    let canary = |i: usize| pattern(MISUSE_LEN, 100 + i as u64);
    let mut regions: Vec<Option<MemoryRegion>> = Vec::new();
    for (i, (_, access)) in REGIONS.iter().take(4).enumerate() {
        let mr = MemoryRegion::alloc(&h.pd, MISUSE_LEN, *access)?;
        mr.write_at(0, &canary(i))?;
        regions.push(Some(mr));
    }
    let described: Vec<RemoteBuffer> = regions.iter().flatten().map(MemoryRegion::remote).collect();
    let mut first = true;
    for (case, _) in MISUSES {
        step(ctl, case)?;
        let (qp, _) = h.connect(ctl, cfg, if first { described.clone() } else { vec![] })?;
        if first {
            first = false;
            // Deregister `gone`, then register `fresh`, which may take its slot.
            regions[3] = None;
            let fresh = MemoryRegion::alloc(&h.pd, MISUSE_LEN, REGIONS[4].1)?;
            fresh.write_at(0, &canary(4))?;
            regions.push(Some(fresh));
        }
        answer(ctl, "completed", || {
            let untouched =
                regions.iter().enumerate().all(|(i, r)| r.as_ref().is_none_or(|mr| mr.to_vec().is_ok_and(|v| v == canary(i))));
            Ok(json!({ "untouched": untouched, "qp_state": format!("{:?}", qp.state()?) }))
        })?;
    }
    step(ctl, "bounds check, then valid traffic")?;
    let (_qp, _) = h.connect(ctl, cfg, vec![])?;
    answer(ctl, "valid traffic done", || {
        let rw = regions[0].as_ref().ok_or("rw region missing")?;
        let rw_written = rw.to_vec()? == pattern(MISUSE_LEN, 77);
        let others_untouched =
            regions.iter().enumerate().skip(1).all(|(i, r)| r.as_ref().is_none_or(|mr| mr.to_vec().is_ok_and(|v| v == canary(i))));
        Ok(json!({ "rw_written": rw_written, "others_untouched": others_untouched }))
    })
}
