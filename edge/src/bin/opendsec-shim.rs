//! The detached parent of one container sandbox; started by the edge, never by hand.
//! Usage: opendsec-shim <sandbox dir> [--create-only]   (see `opendsec_edge::container::shim`).

fn main() {
    let mut args = std::env::args_os().skip(1);
    let dir = args.next();
    let flag = args.next();
    let create_only = flag.as_deref() == Some(std::ffi::OsStr::new("--create-only"));
    let (Some(dir), None) = (dir, args.next()) else {
        eprintln!("usage: opendsec-shim <sandbox dir> [--create-only]");
        std::process::exit(2);
    };
    if flag.is_some() && !create_only {
        eprintln!("usage: opendsec-shim <sandbox dir> [--create-only]");
        std::process::exit(2);
    }
    opendsec_edge::container::shim::main(std::path::Path::new(&dir), create_only)
}
