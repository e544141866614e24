// Compiles the peer-port `Control` service with protox (no protoc binary needed). The
// edges' `EdgeSlice` service is compiled by the contract crate (edge/api).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/opendsec/control/v1/control.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .btree_map(".")
        .compile_fds(fds)?;
    Ok(())
}
