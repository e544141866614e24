//! `opendsec-vm-shim <launch.json>`: the detached parent of one QEMU process (see
//! `opendsec_edge::vm::shim`).

fn main() {
    let Some(launch) = std::env::args_os().nth(1) else {
        eprintln!("usage: opendsec-vm-shim <launch.json>");
        std::process::exit(2);
    };
    opendsec_edge::vm::shim::main(std::path::Path::new(&launch))
}
