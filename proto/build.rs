//! Compiles our .proto files with protox (pure Rust), so a fresh machine
//! needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/quotalease.proto",
        "proto/lease.proto",
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/envoy/extensions/common/ratelimit/v3/ratelimit.proto",
        "proto/envoy/type/v3/ratelimit_unit.proto",
        "proto/envoy/config/core/v3/base.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    // The services' clients and servers only with the `grpc` feature.
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    tonic_prost_build::configure()
        .build_client(grpc)
        .build_server(grpc)
        .compile_fds(fds)?;
    Ok(())
}
