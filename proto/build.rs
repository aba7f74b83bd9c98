//! Compiles our .proto files with protox (pure Rust), so a fresh machine
//! needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/quotalease.proto", "proto/lease.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
