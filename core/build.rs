fn main() {
    // Record the libtorch this copy of rak-core is compiled against; every plugin compiles its
    // own copy, so the constant in a plugin's header says what *that* plugin was built with.
    rak_build::record_libtorch_version();
    println!("cargo:rustc-env=RAK_TARGET={}", std::env::var("TARGET").unwrap());
}
