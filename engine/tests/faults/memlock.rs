//! The locked-memory limit: registration past it is a typed error naming
//! the limit and the fix.

use super::*;

/// Locked-memory limit the unprivileged child runs under.
const MEMLOCK_LIMIT: u64 = 1 << 20;

/// A: runs `memlock-child` as an unprivileged user under a 1 MiB
/// `RLIMIT_MEMLOCK` (root has CAP_IPC_LOCK and is never limited).
pub(super) fn memlock(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    if role == Role::A {
        let exe = std::env::current_exe()?;
        let limit = MEMLOCK_LIMIT.to_string();
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"])
            .args(["prlimit", &format!("--memlock={limit}:{limit}"), "--"])
            .arg(&exe)
            .arg("memlock-child")
            .stdin(Stdio::null())
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        ensure!(out.status.success(), "memlock child failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    step(&mut ctl, "memlock done")
}

pub(super) fn memlock_child() -> R<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(unsafe { libc::geteuid() } != 0, "memlock-child must run unprivileged");
    let ctx = Context::open(Some(&device()))?;
    let pd = ProtectionDomain::new(&ctx)?;
    let small = MemoryRegion::alloc(&pd, 256 << 10, AccessFlags::default())?;
    let t = Instant::now();
    let err = match MemoryRegion::alloc(&pd, 2 << 20, AccessFlags::default()) {
        Ok(_) => return Err("registering 2 MiB under a 1 MiB locked-memory limit succeeded".into()),
        Err(e) => e,
    };
    let took = t.elapsed();
    let text = err.to_string();
    figure(json!({ "scenario": "memlock", "limit": MEMLOCK_LIMIT, "requested": 2 << 20, "error": text, "took_ms": took.as_millis() as u64 }));
    ensure!(
        matches!(err, Error::LockedMemoryLimit { limit: MEMLOCK_LIMIT, requested, pinned: Some(p), .. }
            if requested == 2 << 20 && p >= 256 << 10),
        "expected Error::LockedMemoryLimit naming the 1 MiB limit, got {err:?}"
    );
    ensure!(text.contains("ulimit -l"), "the error does not say how to raise the limit: {text}");
    ensure!(took < Duration::from_secs(2), "the refusal took {took:?}");
    // Deregistering returns the pages to the budget.
    drop(small);
    let again = MemoryRegion::alloc(&pd, 768 << 10, AccessFlags::default());
    ensure!(again.is_ok(), "768 KiB after freeing 256 KiB under a 1 MiB limit failed: {:?}", again.err());
    Ok(())
}
