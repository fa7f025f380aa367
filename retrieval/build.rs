fn main() {
    // The tests and examples call libtorch (flat search uses its matmul).
    rak_build::link_libtorch();
}
