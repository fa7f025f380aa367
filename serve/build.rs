fn main() {
    // The tests call libtorch (encoders and flat search).
    rak_build::link_libtorch();
}
