fn main() {
    rak_build::link_libtorch();
}
