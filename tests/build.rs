fn main() {
    // The test binaries call libtorch directly (tch's own AdamW as the reference).
    rak_build::link_libtorch();
}
