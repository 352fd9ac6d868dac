//! Compiles the data-plane protocol with a pure-Rust protobuf compiler, so
//! building needs no `protoc`.

fn main() {
    let proto = "proto/shardplane/dataplane/v1/dataplane.proto";
    println!("cargo:rerun-if-changed={proto}");
    let files = protox::compile([proto], ["proto"]).unwrap_or_else(|e| panic!("{proto}: {e}"));
    tonic_prost_build::configure()
        // Bulk payloads stay in the buffers they arrived in (no copy on decode).
        .bytes(".shardplane.dataplane.v1.BlobChunk.data")
        .bytes(".shardplane.dataplane.v1.Hidden.data")
        .compile_fds(files)
        .unwrap_or_else(|e| panic!("{proto}: {e}"));
}
