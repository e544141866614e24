//! nftables in-process: the system's libnftables (the library the `nft` binary is, from
//! the same package) opened at run time, one context behind a lock. A transaction costs
//! what the kernel takes (a cache check and one netlink batch), not a process: ~1 ms
//! where `nft -f -` takes 5 to 20 ms on a busy host, on the path of every create that
//! claims a warm container and of every DNS answer that opens addresses. The library
//! parses the same scripts `nft -f` reads, so the two are interchangeable.
//!
//! Hand-written FFI (the code map says why): no crate binds libnftables; the six calls
//! used are its stable public API (`nftables/libnftables.h`, `nft_ctx_new`,
//! `nft_run_cmd_from_buffer`, ...). Where the library cannot be opened, `nft.rs` runs
//! the binary instead.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::{Mutex, OnceLock};

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxInt = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxStr = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunCmd = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

struct Lib {
    ctx: *mut c_void,
    run: RunCmd,
    output: CtxStr,
    error: CtxStr,
}

// SAFETY: the context is only used under the Mutex below, one call at a time.
unsafe impl Send for Lib {}

static LIB: OnceLock<Option<Mutex<Lib>>> = OnceLock::new();

fn open() -> Option<Mutex<Lib>> {
    // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast to the type
    // libnftables.h declares for it.
    unsafe {
        let h = libc::dlopen(c"libnftables.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return None;
        }
        let sym = |name: &CStr| {
            let p = libc::dlsym(h, name.as_ptr());
            (!p.is_null()).then_some(p)
        };
        let new: CtxNew = std::mem::transmute(sym(c"nft_ctx_new")?);
        let buffer_output: CtxInt = std::mem::transmute(sym(c"nft_ctx_buffer_output")?);
        let buffer_error: CtxInt = std::mem::transmute(sym(c"nft_ctx_buffer_error")?);
        let lib = Lib {
            ctx: new(0),
            run: std::mem::transmute::<*mut c_void, RunCmd>(sym(c"nft_run_cmd_from_buffer")?),
            output: std::mem::transmute::<*mut c_void, CtxStr>(sym(c"nft_ctx_get_output_buffer")?),
            error: std::mem::transmute::<*mut c_void, CtxStr>(sym(c"nft_ctx_get_error_buffer")?),
        };
        if lib.ctx.is_null() || buffer_output(lib.ctx) != 0 || buffer_error(lib.ctx) != 0 {
            return None;
        }
        Some(Mutex::new(lib))
    }
}

/// Runs `script` as `nft -f -` would (one transaction): `None` where libnftables cannot
/// be opened (the caller runs the binary), else what it printed, or its error message.
pub fn run(script: &str) -> Option<Result<String, String>> {
    let lib = LIB.get_or_init(open).as_ref()?;
    let Ok(text) = CString::new(script) else {
        return Some(Err("the script holds a NUL byte".into()));
    };
    let lib = lib.lock().expect("libnftables lock");
    // SAFETY: a valid context and NUL-terminated script; the buffers it returns are
    // NUL-terminated and live until the next call, which the lock keeps from coming.
    unsafe {
        let rc = (lib.run)(lib.ctx, text.as_ptr());
        let read = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let out = read((lib.output)(lib.ctx));
        let err = read((lib.error)(lib.ctx));
        Some(if rc == 0 { Ok(out) } else { Err(err) })
    }
}
