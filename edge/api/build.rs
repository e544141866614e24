// Compiles the slice and report protocol with protox (no protoc binary needed). The
// event schema is imported from projections/ and mapped onto its generated types, so an
// `Envelope` in a slice entry is the projections crate's own type.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/opendsec/edge/v1/edge.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-changed=../../projections/proto");
    let fds = protox::compile([proto], ["proto", "../../projections/proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .btree_map(".")
        .extern_path(".opendsec.events.v1", "::opendsec_projections::pb")
        .compile_fds(fds)?;
    Ok(())
}
