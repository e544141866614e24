//! The detached parent of one container sandbox; started by the edge, never by hand.
//! Usage: opendsec-shim <sandbox dir>   (see `opendsec_edge::container::shim`).

fn main() {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: opendsec-shim <sandbox dir>");
        std::process::exit(2);
    };
    opendsec_edge::container::shim::main(std::path::Path::new(&dir))
}
