fn main() {
    // Record the libtorch and target this copy is compiled for: every plugin compiles its own
    // copy, so the header it exports says what *that* plugin was built with.
    rak_build::link_libtorch();
    println!("cargo:rustc-env=RAK_TARGET={}", std::env::var("TARGET").unwrap());
}
