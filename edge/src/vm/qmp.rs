//! A small blocking QMP client: the greeting, capabilities negotiation, commands with
//! ids, asynchronous events kept aside until asked for, and file descriptors passed
//! with a command (SCM_RIGHTS), which is how migration streams reach QEMU without QEMU
//! opening files or running programs. One connection per operation: QEMU serves one QMP
//! client at a time, and a driver that reconnects every time can re-adopt a VM after a
//! restart with nothing to restore.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("connecting to {path}: {source}")]
    Connect { path: PathBuf, source: io::Error },
    #[error("QMP socket: {0}")]
    Io(#[from] io::Error),
    /// QEMU refused a command.
    #[error("{command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("unexpected QMP message: {0}")]
    Protocol(String),
    /// QEMU closed the connection (it is exiting or gone).
    #[error("QEMU closed the QMP connection")]
    Closed,
    #[error("no {0} from QEMU in time")]
    Timeout(String),
}

pub struct Qmp {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    partial: String,
    events: VecDeque<Value>,
    next_id: u64,
    timeout: Duration,
}

impl Qmp {
    /// Connects, reads the greeting and leaves negotiation mode.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path).map_err(|source| QmpError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let reader = BufReader::new(stream.try_clone()?);
        let mut qmp = Qmp {
            stream,
            reader,
            partial: String::new(),
            events: VecDeque::new(),
            next_id: 1,
            timeout,
        };
        let greeting = qmp.read_message(Instant::now() + timeout, "the QMP greeting")?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(greeting.to_string()));
        }
        qmp.execute("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    /// Connects, retrying until QEMU has created its socket or `deadline` passes.
    pub fn connect_until(path: &Path, deadline: Instant, alive: &dyn Fn() -> bool) -> Result<Self, QmpError> {
        loop {
            match Self::connect(path, Duration::from_secs(30)) {
                Ok(q) => return Ok(q),
                Err(QmpError::Connect { source, .. })
                    if matches!(
                        source.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) && Instant::now() < deadline
                        && alive() =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs `command` and returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, None)
    }

    /// Runs `command` with `fd` attached (for `getfd` and `add-fd`).
    pub fn execute_with_fd(&mut self, command: &str, arguments: Value, fd: RawFd) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, Some(fd))
    }

    fn execute_inner(&mut self, command: &str, arguments: Value, fd: Option<RawFd>) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = json!({"execute": command, "arguments": arguments, "id": id}).to_string();
        line.push('\n');
        match fd {
            None => self.stream.write_all(line.as_bytes())?,
            Some(fd) => send_with_fd(&self.stream, line.as_bytes(), fd)?,
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let message = self.read_message(deadline, &format!("the reply to {command}"))?;
            if message.get("event").is_some() {
                self.events.push_back(message);
                continue;
            }
            if message.get("id").and_then(Value::as_u64) != Some(id) {
                return Err(QmpError::Protocol(message.to_string()));
            }
            if let Some(ret) = message.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = message.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Command {
                    command: command.into(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            return Err(QmpError::Protocol(message.to_string()));
        }
    }

    /// Waits for event `name` (already received or still to come).
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Result<Value, QmpError> {
        if let Some(i) = self.events.iter().position(|e| e["event"] == name) {
            return Ok(self.events.remove(i).expect("index in range"));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let message = self.read_message(deadline, &format!("event {name}"))?;
            if message["event"] == name {
                return Ok(message);
            }
            if message.get("event").is_some() {
                self.events.push_back(message);
            }
        }
    }

    /// Events received so far (and not yet waited for), oldest first.
    pub fn take_events(&mut self) -> Vec<Value> {
        self.events.drain(..).collect()
    }

    fn read_message(&mut self, deadline: Instant, what: &str) -> Result<Value, QmpError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(QmpError::Timeout(what.into()));
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.reader.read_line(&mut self.partial) {
                Ok(0) => return Err(QmpError::Closed),
                Ok(_) if self.partial.ends_with('\n') => {
                    let line = std::mem::take(&mut self.partial);
                    return serde_json::from_str(&line)
                        .map_err(|e| QmpError::Protocol(format!("{e}: {}", line.trim())));
                }
                Ok(_) => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Err(QmpError::Closed);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Sends `bytes` with `fd` attached as SCM_RIGHTS.
fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    // SAFETY: the control buffer is sized with CMSG_SPACE for one fd and zeroed; every
    // pointer handed to sendmsg points into live locals.
    unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        let sent = libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        if (sent as usize) < bytes.len() {
            // The fd went with the first bytes; the rest follows as plain data.
            (&*stream).write_all(&bytes[sent as usize..])?;
        }
    }
    Ok(())
}
