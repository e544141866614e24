//! The detached parent of one container sandbox; started by the edge, never by hand.
//! Usage: opendsec-shim <sandbox dir> [--create-only]   (see `opendsec_edge::container::shim`).

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let (dir, create_only) = match args.as_slice() {
        [dir] => (dir, false),
        [dir, flag] if flag == "--create-only" => (dir, true),
        _ => {
            eprintln!("usage: opendsec-shim <sandbox dir> [--create-only]");
            std::process::exit(2);
        }
    };
    opendsec_edge::container::shim::main(std::path::Path::new(dir), create_only)
}
