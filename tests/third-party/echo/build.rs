fn main() {
    // rpath to the project's libtorch, and libtorch_cuda when present.
    rak_build::link_libtorch();
}
