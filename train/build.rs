fn main() {
    // Tests call libtorch.
    rak_build::link_libtorch();
}
