fn main() {
    // Record the libtorch this copy of rak-core is compiled against; every plugin compiles its
    // own copy, so the constant in a plugin's header says what *that* plugin was built with.
    // Linking (rpath, libtorch_cuda) only reaches this crate's own test binaries: a
    // library's link args are not passed on to its dependents.
    rak_build::link_libtorch();
    println!("cargo:rustc-env=RAK_TARGET={}", std::env::var("TARGET").unwrap());
}
