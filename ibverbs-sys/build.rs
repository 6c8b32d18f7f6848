//! Generates the libibverbs bindings from the system's rdma-core headers.
//!
//! rdma-core defines the data-path verbs (`ibv_post_send`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`, ...) as `static inline` functions that jump through
//! the provider's ops table, so there is no symbol to link against. bindgen's
//! `wrap_static_fns` writes a C file with one exported wrapper per inline
//! function and `cc` compiles it: the bodies always come from the installed
//! headers and cannot drift from them.

use std::env;
use std::path::{Path, PathBuf};

const PACKAGES: &str = "libibverbs-dev libclang-dev pkg-config";
/// With the `rdmacm` feature.
const RDMACM_PACKAGE: &str = "librdmacm-dev";

fn fail(what: &str) -> ! {
    eprintln!();
    eprintln!("error: gpudirect-sys cannot be built: {what}");
    eprintln!("  On Debian or Ubuntu install the rdma-core headers and libclang:");
    let cm = if env::var_os("CARGO_FEATURE_RDMACM").is_some() { format!(" {RDMACM_PACKAGE}") } else { String::new() };
    eprintln!("      sudo apt-get install {PACKAGES}{cm}");
    eprintln!("  On Fedora/RHEL: sudo dnf install rdma-core-devel clang-devel pkgconf");
    eprintln!("  Or point IBVERBS_INCLUDE_DIR (the folder holding infiniband/verbs.h)");
    eprintln!("  and IBVERBS_LIB_DIR (the folder holding libibverbs.so) at an rdma-core build.");
    eprintln!();
    std::process::exit(1);
}

/// The include folders for `infiniband/verbs.h` and libibverbs' version;
/// emits the link flags.
fn locate() -> (Vec<PathBuf>, String) {
    println!("cargo:rerun-if-env-changed=IBVERBS_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=IBVERBS_LIB_DIR");
    let inc = env::var_os("IBVERBS_INCLUDE_DIR").map(PathBuf::from);
    let lib = env::var_os("IBVERBS_LIB_DIR").map(PathBuf::from);
    if inc.is_some() || lib.is_some() {
        let (Some(inc), Some(lib)) = (inc, lib) else {
            fail("set both IBVERBS_INCLUDE_DIR and IBVERBS_LIB_DIR, or neither");
        };
        if !inc.join("infiniband/verbs.h").is_file() {
            fail(&format!("{}/infiniband/verbs.h does not exist", inc.display()));
        }
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=ibverbs");
        return (vec![inc], "unknown (IBVERBS_INCLUDE_DIR)".to_string());
    }
    match pkg_config::Config::new()
        .atleast_version("1.8")
        .probe("libibverbs")
    {
        Ok(lib) => (lib.include_paths, lib.version),
        // The pkg-config crate's own text is a page long; the cause is
        // nearly always the missing -dev package.
        Err(_) => fail("the rdma-core headers were not found (`pkg-config libibverbs` failed)"),
    }
}

/// Where `GPUDIRECT_SYS_WRITE_PREGENERATED=1` writes the bindings that
/// docs.rs builds use.
const PREGENERATED: &str = "src/pregenerated.rs";
/// The same for librdmacm's (feature `rdmacm`).
const PREGENERATED_RDMACM: &str = "src/pregenerated_rdmacm.rs";

/// Writes `text` to a checked-in pregenerated file, with its header.
fn write_pregenerated(here: &Path, file: &str, from: &str, text: &str) {
    let text = format!(
        "// The bindings docs.rs builds use (DOCS_RS set: no headers, no libclang there).\n\
         // Written by build.rs with GPUDIRECT_SYS_WRITE_PREGENERATED=1 from {from}\n\
         // (rdma-core's headers); tests/pregenerated.rs checks that a fresh generation\n\
         // has the same public items. Do not edit.\n{text}"
    );
    std::fs::write(here.join(file), text).unwrap_or_else(|e| fail(&format!("cannot write {file}: {e}")));
}

/// librdmacm's bindings (`<rdma/rdma_cma.h>`), for the `rdmacm` feature:
/// a second generation whose verbs types are the first one's (the
/// generated module starts with `use super::*`), so an `ibv_qp` from either
/// is the same type.
fn rdmacm(here: &Path, out: &Path, includes: &[PathBuf]) {
    println!("cargo:rerun-if-changed=rdmacm.h");
    let version = match pkg_config::Config::new().atleast_version("1.0").probe("librdmacm") {
        Ok(lib) => lib.version,
        Err(_) => fail(&format!(
            "the rdmacm feature needs librdmacm's headers (`pkg-config librdmacm` failed; \
             Debian/Ubuntu: {RDMACM_PACKAGE})"
        )),
    };
    println!("cargo:rustc-env=GPUDIRECT_SYS_LIBRDMACM_VERSION={version}");
    let bindings = bindgen::Builder::default()
        .header(here.join("rdmacm.h").to_string_lossy())
        .clang_args(includes.iter().map(|p| format!("-I{}", p.display())))
        .allowlist_function("rdma_.*")
        .allowlist_type("rdma_.*")
        .allowlist_var("RDMA_.*")
        .allowlist_var("RAI_.*")
        // Everything of verbs.h comes from the main bindings.
        .blocklist_file(".*/infiniband/verbs\\.h")
        // Two static inline accessors of `id->route.addr`: read the field.
        .blocklist_function("rdma_get_(local|peer)_addr")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .derive_debug(true)
        .prepend_enum_name(false)
        .layout_tests(true)
        .impl_debug(true)
        .use_core()
        .raw_line("#[allow(unused_imports)]")
        .raw_line("use super::*;")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen could not parse rdma/rdma_cma.h ({})", e.to_string().trim())));
    bindings
        .write_to_file(out.join("rdmacm.rs"))
        .unwrap_or_else(|e| fail(&format!("cannot write bindings: {e}")));
    if env::var_os("GPUDIRECT_SYS_WRITE_PREGENERATED").is_some() {
        write_pregenerated(here, PREGENERATED_RDMACM, &format!("librdmacm {version}"), &bindings.to_string());
    }
    println!("cargo:rustc-link-lib=dylib=rdmacm");
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    println!("cargo:rerun-if-env-changed=GPUDIRECT_SYS_WRITE_PREGENERATED");
    println!("cargo:rustc-check-cfg=cfg(gpudirect_sys_pregenerated)");
    if env::var_os("DOCS_RS").is_some() {
        // docs.rs has neither rdma-core's headers nor libclang, and a docs
        // build links nothing: the checked-in bindings describe the API.
        println!("cargo:rustc-cfg=gpudirect_sys_pregenerated");
        return;
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let here = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let (includes, version) = locate();
    // For dependents' build scripts (DEP_GPUDIRECT_IBVERBS_INCLUDE) and the
    // pregenerated-bindings test.
    if let Ok(joined) = env::join_paths(&includes) {
        println!("cargo:include={}", joined.to_string_lossy());
    }
    println!("cargo:rustc-env=GPUDIRECT_SYS_LIBIBVERBS_VERSION={version}");
    let header = here.join("wrapper.h");
    let inline_c = out.join("verbs_inline");

    // bindgen panics when it cannot load libclang (already while the
    // builder is configured); turn that into the same one readable message
    // as a missing header, without the panic's backtrace.
    std::panic::set_hook(Box::new(|_| {}));
    let generated = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header(header.to_string_lossy())
            .clang_args(includes.iter().map(|p| format!("-I{}", p.display())))
            .allowlist_function("_*ibv_.*")
            .allowlist_type("_*ibv_.*")
            .allowlist_var("IBV_.*")
            .allowlist_var("IB_UVERBS_.*")
            // Enums stay plain integer constants: a C library may hand back
            // a value this header version does not know, which a Rust enum
            // cannot hold without undefined behaviour.
            .default_enum_style(bindgen::EnumVariation::Consts)
            .derive_default(true)
            .derive_debug(true)
            .prepend_enum_name(false)
            .layout_tests(true)
            // ibv_context and friends embed pthread types; keep them opaque
            // (their layout is libc's business, only their size matters here).
            .allowlist_type("pthread_(mutex|cond)_t")
            .opaque_type("pthread_.*")
            .impl_debug(true)
            .use_core()
            .wrap_static_fns(true)
            .wrap_static_fns_path(&inline_c)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
            .generate()
    });
    let _ = std::panic::take_hook();
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => fail(&format!("bindgen could not parse infiniband/verbs.h ({})", e.to_string().trim())),
        Err(_) => fail("bindgen could not load libclang (set LIBCLANG_PATH if it is installed somewhere unusual)"),
    };
    bindings
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("cannot write bindings: {e}")));
    if env::var_os("GPUDIRECT_SYS_WRITE_PREGENERATED").is_some() {
        write_pregenerated(&here, PREGENERATED, &format!("libibverbs {version}"), &bindings.to_string());
    }
    if env::var_os("CARGO_FEATURE_RDMACM").is_some() {
        rdmacm(&here, &out, &includes);
    }

    let mut cc = cc::Build::new();
    cc.file(inline_c.with_extension("c"))
        .include(&here)
        // The wrappers repeat the inline bodies verbatim; one of them
        // (ibv_alloc_mw) ends without a return on a path rdma-core knows is
        // unreachable.
        .flag_if_supported("-Wno-return-type");
    for p in includes.iter().filter(|p| Path::new(p).is_dir()) {
        cc.include(p);
    }
    cc.compile("ibverbs_inline");
    // Again after the wrappers' static library, which calls into
    // libibverbs: linkers resolve left to right.
    println!("cargo:rustc-link-lib=dylib=ibverbs");
}
