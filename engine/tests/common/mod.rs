//! What the engine's integration tests share: the device under test,
//! agents on loopback, and agents in separate processes finding each
//! other through files. Each test binary uses part of it.
#![allow(dead_code)]

pub use testkit::device;

/// An engine agent on the device under test, listening on loopback (no
/// secret needed there).
pub fn agent(name: &str) -> gpudirect_engine::Agent {
    let mut c = gpudirect_engine::AgentConfig::named(name);
    c.devices = vec![device()];
    c.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    gpudirect_engine::Agent::new(c).unwrap()
}

/// An agent's metadata as a peer gets it: through its binary form.
pub fn metadata(a: &gpudirect_engine::Agent) -> gpudirect_engine::AgentMetadata {
    gpudirect_engine::AgentMetadata::decode(&a.metadata().encode().unwrap()).unwrap()
}

/// Agents of one test in separate processes find each other through
/// files in a shared directory: each publishes its metadata as
/// `dir/NAME.md` and waits for the others' (`engine_scale`,
/// `engine_broadcast`).
pub mod files {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use gpudirect_engine::AgentMetadata;

    pub type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

    /// Publishes `md` as `dir/NAME.md`, whole (written aside, then renamed).
    pub fn publish(dir: &Path, md: &AgentMetadata) -> R<()> {
        let tmp = dir.join(format!(".{}.tmp", md.name));
        std::fs::write(&tmp, md.encode()?)?;
        std::fs::rename(tmp, dir.join(format!("{}.md", md.name)))?;
        Ok(())
    }

    /// Waits up to `within` for `path` to exist and returns its bytes.
    pub fn wait_for(path: &Path, within: Duration) -> R<Vec<u8>> {
        let started = Instant::now();
        loop {
            match std::fs::read(path) {
                Ok(b) => return Ok(b),
                Err(_) if started.elapsed() < within => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(format!("{}: {e}", path.display()).into()),
            }
        }
    }

    /// Waits for `dir/NAME.md` and decodes it.
    pub fn lookup(dir: &Path, name: &str, within: Duration) -> R<AgentMetadata> {
        Ok(AgentMetadata::decode(&wait_for(&dir.join(format!("{name}.md")), within)?)?)
    }
}

