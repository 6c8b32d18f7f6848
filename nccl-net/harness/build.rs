fn main() {
    println!("cargo:rerun-if-changed=logger.c");
    cc::Build::new().file("logger.c").warnings(true).compile("harness_logger");
}
