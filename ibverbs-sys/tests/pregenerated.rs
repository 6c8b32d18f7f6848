//! The bindings checked in for docs.rs builds (`src/pregenerated.rs`) must
//! describe the same API as a fresh generation on this machine: every `pub`
//! line (items, fields, signatures) equal. Regenerate with
//! `GPUDIRECT_SYS_WRITE_PREGENERATED=1 cargo build -p gpudirect-sys`.

const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/bindings.rs"));
const PREGENERATED: &str = include_str!("../src/pregenerated.rs");

fn public_lines(text: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = text.lines().map(str::trim).filter(|l| l.starts_with("pub ")).collect();
    lines.sort_unstable();
    lines
}

#[test]
fn pregenerated_bindings_match_a_fresh_generation() {
    let version = env!("GPUDIRECT_SYS_LIBIBVERBS_VERSION");
    assert!(
        PREGENERATED.lines().take(4).any(|l| l.contains(&format!("libibverbs {version}"))),
        "src/pregenerated.rs was generated from other headers than this machine's libibverbs {version}; \
         compare on a machine with the headers it names, or regenerate (see this file's header)"
    );
    let (fresh, checked_in) = (public_lines(GENERATED), public_lines(PREGENERATED));
    assert!(fresh.len() > 1000, "only {} pub lines generated", fresh.len());
    let missing: Vec<&&str> = fresh.iter().filter(|l| checked_in.binary_search(l).is_err()).take(10).collect();
    let extra: Vec<&&str> = checked_in.iter().filter(|l| fresh.binary_search(l).is_err()).take(10).collect();
    assert!(
        missing.is_empty() && extra.is_empty() && fresh.len() == checked_in.len(),
        "src/pregenerated.rs differs from a fresh generation: missing {missing:?}, extra {extra:?}; regenerate it"
    );
}

#[cfg(feature = "rdmacm")]
#[test]
fn pregenerated_rdmacm_bindings_match_a_fresh_generation() {
    let generated = include_str!(concat!(env!("OUT_DIR"), "/rdmacm.rs"));
    let pregenerated = include_str!("../src/pregenerated_rdmacm.rs");
    let version = env!("GPUDIRECT_SYS_LIBRDMACM_VERSION");
    assert!(
        pregenerated.lines().take(4).any(|l| l.contains(&format!("librdmacm {version}"))),
        "src/pregenerated_rdmacm.rs was generated from other headers than this machine's librdmacm {version}"
    );
    let (fresh, checked_in) = (public_lines(generated), public_lines(pregenerated));
    assert!(fresh.len() > 100, "only {} pub lines generated", fresh.len());
    assert_eq!(fresh, checked_in, "src/pregenerated_rdmacm.rs differs from a fresh generation; regenerate it");
}
