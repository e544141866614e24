// Compiles the event schema with protox (pure Rust; no protoc binary needed).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/opendsec/events/v1/events.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().btree_map(["."]).compile_fds(fds)?;
    Ok(())
}
