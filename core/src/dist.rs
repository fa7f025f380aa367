//! Multi-process groups over libtorch's own c10d (`shim/csrc/dist.cpp`): a TCPStore rendezvous and a
//! Gloo process group, with the collectives data-parallel training needs (sum, gather,
//! broadcast, barrier). The same engine `torch.distributed` runs, so the usual launch variables
//! (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) mean what they mean there.
//!
//! Collectives carry no autograd: a caller that gathers embeddings for the loss puts its own
//! slice, with its graph, back in place of the gathered copy.

use anyhow::{bail, Context, Result};
use std::time::Duration;
use tch::Tensor;

/// Where and how a process joins its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// The store's host (rank 0's address) and port. Rank 0's store listens on this address
    /// only (libtorch's own TCPStore would listen on every interface).
    pub host: String,
    pub port: u16,
    /// A socket already bound to the store's address and listening, for rank 0's store to
    /// serve on (`RAK_DIST_LISTEN_FD`: `host train --nproc` binds port 0 itself and hands the
    /// socket to rank 0, so no other program can take the port between its choice and its
    /// use). The first `join` takes it over. `None`: rank 0 binds `host:port` itself.
    pub listen_fd: Option<i32>,
    pub rank: usize,
    pub world: usize,
    /// The store is already served (torchrun's agent store): every rank connects as a client.
    pub store_is_client: bool,
    /// Where this process's Gloo sockets bind: "" this machine's hostname's address (Gloo's
    /// default), `iface:NAME` an interface (`GLOO_SOCKET_IFNAME`), else a host or address.
    pub bind: String,
    /// The group's keys in the store start with it (a restarted job starts afresh).
    pub prefix: String,
    /// Bounds the rendezvous and every collective: a rank that dies makes the others fail
    /// within it instead of hanging.
    pub timeout: Duration,
    /// Also join an NCCL group, which then carries the collectives of CUDA tensors (Gloo
    /// keeps CPU tensors and barriers), as torch's `cpu:gloo,cuda:nccl` does.
    pub nccl: bool,
}

impl Rendezvous {
    /// From the launch variables torchrun and the like set: `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR` (default 127.0.0.1), `MASTER_PORT`, and `TORCHELASTIC_USE_AGENT_STORE`
    /// (`True`: the agent serves the store), `GLOO_SOCKET_IFNAME` (the interface to bind; with
    /// none, loopback when `MASTER_ADDR` is a loopback address, else Gloo's default) and
    /// `TORCHELASTIC_RESTART_COUNT`, and `RAK_DIST_LISTEN_FD` (rank 0: the store's listening
    /// socket, from `host train --nproc`). `None` when `WORLD_SIZE` is unset.
    pub fn from_env(timeout: Duration) -> Result<Option<Self>> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let Some(world) = var("WORLD_SIZE") else { return Ok(None) };
        let num = |name: &str, v: &str| -> Result<usize> { v.parse().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a whole number")) };
        let world = num("WORLD_SIZE", &world)?;
        let Some(rank) = var("RANK") else { bail!("WORLD_SIZE is set but RANK is not: set both, as torchrun does") };
        let rank = num("RANK", &rank)?;
        let Some(port) = var("MASTER_PORT") else { bail!("WORLD_SIZE is set but MASTER_PORT is not: the rendezvous needs rank 0's port") };
        let port: u16 = port.parse().map_err(|_| anyhow::anyhow!("MASTER_PORT={port:?} is not a port number"))?;
        let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let listen_fd = match var("RAK_DIST_LISTEN_FD") {
            Some(v) => Some(v.parse::<i32>().ok().filter(|fd| *fd >= 0).ok_or_else(|| anyhow::anyhow!("RAK_DIST_LISTEN_FD={v:?} is not a file descriptor"))?),
            None => None,
        };
        let bind = match var("GLOO_SOCKET_IFNAME") {
            Some(iface) => format!("iface:{iface}"),
            None if host.starts_with("127.") || host == "localhost" => "127.0.0.1".into(),
            None => String::new(),
        };
        let r = Rendezvous {
            host,
            port,
            listen_fd,
            rank,
            world,
            store_is_client: var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")),
            bind,
            prefix: format!("rak/{}", var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())),
            timeout,
            nccl: false,
        };
        r.check()?;
        Ok(Some(r))
    }

    fn check(&self) -> Result<()> {
        if self.world == 0 || self.rank >= self.world {
            bail!("rank {} of a world of {}: the rank must be below the world size", self.rank, self.world);
        }
        Ok(())
    }

    /// Whether this process serves the store (rank 0, unless a launcher's agent does).
    pub fn serves_store(&self) -> bool {
        self.rank == 0 && !self.store_is_client
    }
}

/// The socket rank 0's store serves on: the one handed over (checked to be a listening TCP
/// socket), else a new one bound to `host:port` (every address `host` resolves to is tried).
/// The caller owns the returned descriptor.
#[cfg_attr(not(rak_c10d), allow(dead_code))]
fn store_socket(r: &Rendezvous) -> Result<i32> {
    use std::os::fd::IntoRawFd;
    if let Some(fd) = r.listen_fd {
        let mut listening: libc::c_int = 0;
        let mut size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reads one int option of a descriptor into a buffer of its size.
        let ok = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, (&mut listening as *mut libc::c_int).cast(), &mut size) } == 0;
        if !ok || listening == 0 {
            bail!("RAK_DIST_LISTEN_FD={fd} is not a listening socket of this process");
        }
        // Close-on-exec from here on: the launcher cleared the flag so that this process
        // inherits it; nothing this process starts should.
        // SAFETY: sets a descriptor flag of a descriptor this process holds.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
            bail!("RAK_DIST_LISTEN_FD={fd}: cannot make it close-on-exec: {}", std::io::Error::last_os_error());
        }
        return Ok(fd);
    }
    let listener = std::net::TcpListener::bind((r.host.as_str(), r.port))
        .with_context(|| format!("rank 0 cannot listen on MASTER_ADDR {}, MASTER_PORT {} for the rendezvous (MASTER_ADDR must be an address of this machine)", r.host, r.port))?;
    let bound = listener.local_addr().context("the rendezvous socket's address")?;
    let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok());
    if let Some(warning) = reachable_store(&r.host, bound.ip(), local, r.world)? {
        eprintln!("warning: {warning}");
    }
    Ok(listener.into_raw_fd())
}

/// Whether the other ranks can reach a store bound to `bound` for `MASTER_ADDR` `host`: a host
/// name that resolves to loopback on rank 0's machine (Debian and Ubuntu map the machine's own
/// name to 127.0.1.1 in /etc/hosts) would leave ranks on other machines waiting out the
/// rendezvous timeout. Refused when `LOCAL_WORLD_SIZE` says some ranks run elsewhere; a
/// warning when nothing says where they run.
#[cfg_attr(not(rak_c10d), allow(dead_code))]
fn reachable_store(host: &str, bound: std::net::IpAddr, local_world: Option<usize>, world: usize) -> Result<Option<String>> {
    if !bound.is_loopback() || is_loopback_name(host) {
        return Ok(None);
    }
    let what = format!(
        "MASTER_ADDR {host} resolves to {bound} on rank 0's machine, a loopback address: ranks on other machines cannot reach the rendezvous there; set MASTER_ADDR to an address of this machine that they reach (e.g. from `hostname -I`)"
    );
    match local_world {
        Some(l) if l >= world => Ok(None),
        Some(_) => bail!("{what}"),
        None => Ok(Some(format!("{what} (ignore this if every rank runs on this machine)"))),
    }
}

/// Whether a `MASTER_ADDR` names loopback itself (an address or `localhost`), not a host name
/// that happens to resolve to it.
#[cfg_attr(not(rak_c10d), allow(dead_code))]
fn is_loopback_name(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A joined process group. Dropping it leaves the group.
pub struct ProcessGroup {
    #[cfg_attr(not(rak_c10d), allow(dead_code))]
    handle: *mut std::ffi::c_void,
    rank: usize,
    world: usize,
    /// How many rank-0-only phases the group has been through: their keys in the store are
    /// numbered, so no phase ever finds an earlier one's mark.
    lead_phases: u64,
}

// SAFETY: c10d process groups are used from one thread at a time here (`&mut self` for every
// collective); moving the handle between threads is what torch's own Python bindings do.
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }
}

#[cfg(not(rak_c10d))]
mod imp {
    use super::*;

    const MISSING: &str = "this build has no multi-process training: Gloo's headers were not found when it was built \
         (apt install libgloo-dev, then cargo clean -p rak-torch-shim and rebuild; or set RAK_GLOO_INCLUDE)";

    impl ProcessGroup {
        pub fn join(r: &Rendezvous) -> Result<Self> {
            r.check()?;
            bail!("{MISSING}")
        }
        pub fn all_reduce_sum(&mut self, _tensors: &[&Tensor]) -> Result<()> {
            bail!("{MISSING}")
        }
        pub fn all_gather(&mut self, _t: &Tensor) -> Result<Vec<Tensor>> {
            bail!("{MISSING}")
        }
        pub fn broadcast(&mut self, _t: &Tensor, _root: usize) -> Result<()> {
            bail!("{MISSING}")
        }
        pub fn barrier(&mut self) -> Result<()> {
            bail!("{MISSING}")
        }
        pub(super) fn store_set(&mut self, _key: &str, _value: &str) -> Result<()> {
            bail!("{MISSING}")
        }
        pub(super) fn store_check(&mut self, _key: &str) -> Result<bool> {
            bail!("{MISSING}")
        }
    }

    pub const AVAILABLE: bool = false;

    pub fn nccl_available() -> bool {
        false
    }
}

#[cfg(rak_c10d)]
mod imp {
    use super::*;
    use std::ffi::{c_char, c_long, c_void, CString};

    extern "C" {
        fn rak_dist_init(
            host: *const c_char,
            port: i32,
            listen_fd: i32,
            rank: i32,
            world: i32,
            store_is_client: i32,
            prefix: *const c_char,
            bind: *const c_char,
            timeout_ms: c_long,
            nccl: i32,
            err: *mut c_char,
            len: usize,
        ) -> *mut c_void;
        fn rak_dist_has_nccl() -> i32;
        fn rak_dist_free(g: *mut c_void);
        fn rak_dist_allreduce_sum(g: *mut c_void, t: *mut c_void, err: *mut c_char, len: usize) -> i32;
        fn rak_dist_allgather(g: *mut c_void, input: *mut c_void, outputs: *mut *mut c_void, world: i32, err: *mut c_char, len: usize) -> i32;
        fn rak_dist_broadcast(g: *mut c_void, t: *mut c_void, root: i32, err: *mut c_char, len: usize) -> i32;
        fn rak_dist_barrier(g: *mut c_void, err: *mut c_char, len: usize) -> i32;
        fn rak_dist_store_set(g: *mut c_void, key: *const c_char, value: *const c_char, err: *mut c_char, len: usize) -> i32;
        fn rak_dist_store_check(g: *mut c_void, key: *const c_char, err: *mut c_char, len: usize) -> i32;
    }

    use crate::autograd::message;

    fn ptr(t: &Tensor) -> *mut c_void {
        t.as_ptr() as *mut c_void
    }

    impl ProcessGroup {
        /// Runs one collective of the shim (`call` gets the error buffer; 1 is success) and
        /// names this rank and `what` in its error.
        fn collective(&self, what: &str, call: impl FnOnce(*mut c_char, usize) -> i32) -> Result<()> {
            let mut err = [0 as c_char; 1024];
            if call(err.as_mut_ptr(), err.len()) != 1 {
                bail!("rank {} of {}: {what} failed: {}", self.rank, self.world, message(&err));
            }
            Ok(())
        }

        /// Joins the group (blocks until every rank has, or the timeout passes).
        pub fn join(r: &Rendezvous) -> Result<Self> {
            r.check()?;
            let host = CString::new(r.host.as_str())?;
            let prefix = CString::new(r.prefix.as_str())?;
            let bind = CString::new(r.bind.as_str())?;
            let mut err = [0 as c_char; 1024];
            let timeout_ms = r.timeout.as_millis().min(c_long::MAX as u128) as c_long;
            let listen_fd = if r.serves_store() { store_socket(r)? } else { -1 };
            // SAFETY: the strings and the error buffer outlive the call; the store's server
            // owns `listen_fd` from here on.
            let handle = unsafe {
                rak_dist_init(
                    host.as_ptr(),
                    r.port as i32,
                    listen_fd,
                    r.rank as i32,
                    r.world as i32,
                    r.store_is_client as i32,
                    prefix.as_ptr(),
                    bind.as_ptr(),
                    timeout_ms,
                    r.nccl as i32,
                    err.as_mut_ptr(),
                    err.len(),
                )
            };
            if handle.is_null() {
                // `listen_fd` is not closed: whether the store's server took it over before
                // failing is unknown, and closing it twice could close another file. A process
                // that cannot join leaves anyway.
                bail!("rank {} of {}: cannot join the group at {}:{}: {}", r.rank, r.world, r.host, r.port, message(&err));
            }
            Ok(ProcessGroup { handle, rank: r.rank, world: r.world, lead_phases: 0 })
        }

        /// Sums the tensors in place over every rank (same shapes and kinds on every rank;
        /// several go as one flat buffer, so they must share a kind and a device).
        pub fn all_reduce_sum(&mut self, tensors: &[&Tensor]) -> Result<()> {
            match tensors {
                [] => Ok(()),
                [one] => self.all_reduce_one(one),
                many => {
                    if let Some(t) = many.iter().find(|t| t.kind() != many[0].kind() || t.device() != many[0].device()) {
                        bail!("all-reduce of tensors of {:?} on {:?} and {:?} on {:?}: one kind and device at a time", many[0].kind(), many[0].device(), t.kind(), t.device());
                    }
                    let flat = Tensor::cat(&many.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
                    self.all_reduce_one(&flat)?;
                    let mut at = 0;
                    for t in many {
                        let n = t.numel() as i64;
                        t.shallow_clone().copy_(&flat.narrow(0, at, n).view(t.size().as_slice()));
                        at += n;
                    }
                    Ok(())
                }
            }
        }

        fn all_reduce_one(&mut self, t: &Tensor) -> Result<()> {
            // SAFETY: a live tensor handle for the length of the call.
            self.collective("all-reduce", |err, len| unsafe { rak_dist_allreduce_sum(self.handle, ptr(t), err, len) })
        }

        /// Every rank's `t` (same shape everywhere), in rank order; this rank's slot is a copy.
        pub fn all_gather(&mut self, t: &Tensor) -> Result<Vec<Tensor>> {
            let t = t.contiguous();
            let outputs: Vec<Tensor> = (0..self.world).map(|_| t.empty_like()).collect();
            let mut outs: Vec<*mut c_void> = outputs.iter().map(ptr).collect();
            // SAFETY: live tensor handles for the length of the call.
            self.collective("all-gather", |err, len| unsafe { rak_dist_allgather(self.handle, ptr(&t), outs.as_mut_ptr(), self.world as i32, err, len) })?;
            Ok(outputs)
        }

        /// Copies rank `root`'s `t` into every rank's `t`, in place.
        pub fn broadcast(&mut self, t: &Tensor, root: usize) -> Result<()> {
            // SAFETY: a live tensor handle for the length of the call.
            self.collective(&format!("broadcast from rank {root}"), |err, len| unsafe { rak_dist_broadcast(self.handle, ptr(t), root as i32, err, len) })
        }

        /// Waits until every rank reaches it.
        pub fn barrier(&mut self) -> Result<()> {
            // SAFETY: the group is live.
            self.collective("barrier", |err, len| unsafe { rak_dist_barrier(self.handle, err, len) })
        }

        pub(super) fn store_set(&mut self, key: &str, value: &str) -> Result<()> {
            let (key, value) = (CString::new(key)?, CString::new(value)?);
            // SAFETY: the strings outlive the call.
            self.collective("setting a key of the store", |err, len| unsafe { rak_dist_store_set(self.handle, key.as_ptr(), value.as_ptr(), err, len) })
        }

        pub(super) fn store_check(&mut self, key: &str) -> Result<bool> {
            let key = CString::new(key)?;
            let mut err = [0 as c_char; 1024];
            // SAFETY: the string and the error buffer outlive the call.
            match unsafe { rak_dist_store_check(self.handle, key.as_ptr(), err.as_mut_ptr(), err.len()) } {
                1 => Ok(true),
                0 => Ok(false),
                _ => bail!("{}", message(&err)),
            }
        }
    }

    impl Drop for ProcessGroup {
        fn drop(&mut self) {
            // SAFETY: the handle came from rak_dist_init and is freed once.
            unsafe { rak_dist_free(self.handle) };
        }
    }

    pub const AVAILABLE: bool = true;

    /// Whether this build can join NCCL groups (the CUDA and NCCL headers were found).
    pub fn nccl_available() -> bool {
        // SAFETY: no arguments; reads a compile-time constant.
        unsafe { rak_dist_has_nccl() == 1 }
    }
}

/// Whether this build can join process groups (Gloo's headers were found when it was built).
pub const AVAILABLE: bool = imp::AVAILABLE;

pub use imp::nccl_available;

/// Gradients are summed in buckets of about this many bytes (as DDP's 25 MiB): one
/// collective per bucket instead of one per tensor, without a copy of every gradient at once.
const BUCKET_BYTES: i64 = 25 << 20;

/// How often a rank waiting for rank 0 asks the store whether it is done, and how often it
/// reports that it still waits.
const LEAD_POLL: Duration = Duration::from_millis(200);
const LEAD_NOTICE: Duration = Duration::from_secs(60);

impl ProcessGroup {
    /// The end of a phase that rank 0 runs alone (mining negatives, writing a model) while the
    /// others wait, however long it takes: a barrier would give up after the collective
    /// timeout, which bounds how long a rank waits for a peer that should be at the same
    /// point, not for work of unknown length. Rank 0 calls it when done; the others call it
    /// where they wait, and ask the store whether rank 0 is done every 200 ms, calling
    /// `notice` with the time waited once a minute. A rank 0 that dies takes the store's
    /// server with it (unless a launcher's agent serves the store, as torchrun's does; that
    /// agent then stops the group), so the others fail at their next question instead of
    /// waiting forever. Every rank must call it for the same phases in the same order (like
    /// any collective); `what` names the phase in errors and in the store's key. It ends with
    /// a barrier, so rank 0 does not go on (and, at the end of a run, take the store away)
    /// before the others have seen that it is done.
    pub fn after_lead(&mut self, what: &str, notice: &mut dyn FnMut(Duration)) -> Result<()> {
        self.lead_phases += 1;
        let key = format!("lead/{}/{what}", self.lead_phases);
        if self.rank == 0 {
            self.store_set(&key, "done")?;
        } else {
            let start = std::time::Instant::now();
            let mut noticed = Duration::ZERO;
            loop {
                match self.store_check(&key) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => bail!("rank {} of {}: rank 0 is gone (its store does not answer) while waiting for it to {what}: {e}", self.rank, self.world),
                }
                if start.elapsed() >= noticed + LEAD_NOTICE {
                    noticed += LEAD_NOTICE;
                    notice(start.elapsed());
                }
                std::thread::sleep(LEAD_POLL);
            }
        }
        self.barrier().with_context(|| format!("after rank 0 finished to {what}"))
    }

    /// Every rank's rows of `local` (`[rows, d]`; the row counts may differ between ranks,
    /// and a rank with none may pass `[0, 0]`), stacked in rank order, with this rank's slice
    /// being `local` itself, its autograd graph kept (the others' arrive detached); and where
    /// that slice starts. A loss over the result, backpropagated on every rank, sends each
    /// rank's gradient through its own rows only, so summing the gradients over ranks gives
    /// the gradient of the loss over the whole batch.
    pub fn gather_rows(&mut self, local: &Tensor) -> Result<(Tensor, i64)> {
        let (rows, cols) = local.size2()?;
        let shape = Tensor::from_slice(&[rows, cols]);
        let shapes: Vec<(i64, i64)> = self
            .all_gather(&shape)?
            .iter()
            .map(|t| (t.int64_value(&[0]), t.int64_value(&[1])))
            .collect();
        let width = shapes.iter().map(|s| s.1).max().unwrap_or(0);
        if let Some((r, s)) = shapes.iter().enumerate().find(|(_, s)| s.0 > 0 && s.1 != width) {
            bail!("rank {r} has rows of width {} where another has {width}", s.1);
        }
        let offset: i64 = shapes[..self.rank].iter().map(|s| s.0).sum();
        let most = shapes.iter().map(|s| s.0).max().unwrap_or(0);
        if most == 0 {
            return Ok((local.shallow_clone(), 0));
        }
        // A rank with no rows sends an empty tensor whose kind may be anything: the rows are
        // float32 (the trainer's embeddings) unless a rank with rows says otherwise.
        let kind = if rows > 0 { local.kind() } else { tch::Kind::Float };
        let padded = Tensor::zeros([most, width], (kind, local.device()));
        if rows > 0 {
            padded.narrow(0, 0, rows).copy_(&local.detach());
        }
        let all = self.all_gather(&padded)?;
        let own = if rows > 0 { local.shallow_clone() } else { Tensor::zeros([0, width], (kind, local.device())) };
        let pieces: Vec<Tensor> = all
            .into_iter()
            .zip(&shapes)
            .enumerate()
            .map(|(r, (t, s))| if r == self.rank { own.shallow_clone() } else { t.narrow(0, 0, s.0) })
            .collect();
        Ok((Tensor::cat(&pieces, 0), offset))
    }

    /// Sums each parameter's gradient over the ranks (`grads[i]` belongs to `params[i]`; an
    /// undefined tensor is a parameter this rank's backward did not reach). A parameter no
    /// rank reached keeps an undefined gradient, as in one process over the whole batch; one
    /// that some rank reached gets the sum, zeros standing in for the ranks that did not.
    pub fn all_reduce_gradients(&mut self, params: &[&Tensor], grads: &[Tensor]) -> Result<Vec<Tensor>> {
        if params.len() != grads.len() {
            bail!("{} gradients for {} parameters", grads.len(), params.len());
        }
        let reached = Tensor::from_slice(&grads.iter().map(|g| g.defined() as i32 as f32).collect::<Vec<_>>());
        self.all_reduce_sum(&[&reached])?;
        let reached = Vec::<f32>::try_from(&reached)?;
        let out: Vec<Tensor> = grads
            .iter()
            .zip(params)
            .zip(&reached)
            .map(|((g, p), &n)| match (n > 0.0, g.defined()) {
                (false, _) => Tensor::new(),
                (true, true) => g.contiguous(),
                (true, false) => p.zeros_like(),
            })
            .collect();
        // Buckets of one kind and device, each summed as one flat buffer.
        let mut bucket: Vec<&Tensor> = Vec::new();
        let mut bytes = 0;
        for g in out.iter().filter(|g| g.defined()) {
            let size = g.numel() as i64 * g.kind().elt_size_in_bytes() as i64;
            if let Some(first) = bucket.first() {
                if bytes + size > BUCKET_BYTES || first.kind() != g.kind() || first.device() != g.device() {
                    self.all_reduce_sum(&bucket)?;
                    bucket.clear();
                    bytes = 0;
                }
            }
            bucket.push(g);
            bytes += size;
        }
        self.all_reduce_sum(&bucket)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The local addresses (hex, as the kernel writes them) of this process's LISTEN sockets.
    #[cfg(rak_c10d)]
    fn listening() -> Vec<String> {
        let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter_map(|l| l.to_string_lossy().strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')).map(str::to_string))
            .collect();
        let mut out = Vec::new();
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                    out.push(f[1].to_string());
                }
            }
        }
        out
    }

    /// Rank 0's store listens on the rendezvous address only: libtorch's own TCPStore binds
    /// `::` (every interface) whatever the host, which exposed the unauthenticated store to the
    /// network for the whole run. Both ways in: a socket rank 0 binds itself, and one handed
    /// over (`listen_fd`, as `host train --nproc` does); and the wait for a rank-0-only phase.
    #[cfg(rak_c10d)]
    #[test]
    fn the_store_listens_on_the_rendezvous_address_only() {
        let loopback = |a: &String| {
            let ip = a.split(':').next().unwrap();
            (ip.len() == 8 && ip.ends_with("7F")) || ip == "00000000000000000000000001000000"
        };
        for handed in [false, true] {
            let listener = handed.then(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
            let port = listener.as_ref().map_or(0, |l| l.local_addr().unwrap().port());
            let listen_fd = listener.map(|l| std::os::fd::IntoRawFd::into_raw_fd(l));
            let r = Rendezvous {
                host: "127.0.0.1".into(),
                port,
                listen_fd,
                rank: 0,
                world: 1,
                store_is_client: false,
                bind: "127.0.0.1".into(),
                prefix: format!("test-{handed}"),
                timeout: Duration::from_secs(30),
                nccl: false,
            };
            let mut g = ProcessGroup::join(&r).unwrap();
            let sockets = listening();
            assert!(!sockets.is_empty(), "the store listens nowhere");
            assert!(sockets.iter().all(loopback), "handed over {handed}: a socket listens beyond loopback: {sockets:?}");
            g.after_lead("test", &mut |_| {}).unwrap();
        }
        // A descriptor that is no listening socket is refused, naming the variable.
        let r = Rendezvous { host: "127.0.0.1".into(), port: 0, listen_fd: Some(0), rank: 0, world: 1, store_is_client: false, bind: "127.0.0.1".into(), prefix: "x".into(), timeout: Duration::from_secs(5), nccl: false };
        let err = ProcessGroup::join(&r).err().expect("joined on stdin").to_string();
        assert!(err.contains("RAK_DIST_LISTEN_FD=0 is not a listening socket"), "{err}");
    }

    /// A host name that resolves to loopback is refused when some ranks run on other
    /// machines (they could never reach the store), a warning when nothing says where they run.
    #[test]
    fn a_master_name_that_resolves_to_loopback_is_caught() {
        let lo: std::net::IpAddr = "127.0.1.1".parse().unwrap();
        let err = reachable_store("node0", lo, Some(8), 16).unwrap_err().to_string();
        assert!(err.contains("MASTER_ADDR node0 resolves to 127.0.1.1") && err.contains("hostname -I"), "{err}");
        assert!(reachable_store("node0", lo, None, 16).unwrap().is_some_and(|w| w.contains("ignore this if every rank runs on this machine")));
        assert_eq!(reachable_store("node0", lo, Some(16), 16).unwrap(), None, "one machine holds every rank");
        for literal in ["127.0.0.1", "localhost", "::1", "[::1]"] {
            assert_eq!(reachable_store(literal, lo, Some(1), 16).unwrap(), None, "{literal} asks for loopback");
        }
        assert_eq!(reachable_store("node0", "10.1.2.3".parse().unwrap(), Some(8), 16).unwrap(), None);
    }

    #[test]
    fn launch_variables_are_read_and_checked() {
        // One test touches these variables (tests run in threads of one process).
        let set = |vars: &[(&str, Option<&str>)]| {
            for (k, v) in vars {
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
        };
        let t = Duration::from_secs(5);
        set(&[("WORLD_SIZE", None), ("RANK", None), ("MASTER_ADDR", None), ("MASTER_PORT", None), ("TORCHELASTIC_USE_AGENT_STORE", None), ("GLOO_SOCKET_IFNAME", None), ("TORCHELASTIC_RESTART_COUNT", None), ("RAK_DIST_LISTEN_FD", None)]);
        assert_eq!(Rendezvous::from_env(t).unwrap(), None);
        set(&[("WORLD_SIZE", Some("2")), ("RANK", Some("1")), ("MASTER_PORT", Some("29500"))]);
        let r = Rendezvous::from_env(t).unwrap().unwrap();
        assert_eq!((r.host.as_str(), r.port, r.rank, r.world, r.store_is_client, r.bind.as_str(), r.prefix.as_str()), ("127.0.0.1", 29500, 1, 2, false, "127.0.0.1", "rak/0"));
        assert_eq!(r.listen_fd, None);
        set(&[("RAK_DIST_LISTEN_FD", Some("5"))]);
        assert_eq!(Rendezvous::from_env(t).unwrap().unwrap().listen_fd, Some(5));
        set(&[("RAK_DIST_LISTEN_FD", Some("-1"))]);
        assert!(Rendezvous::from_env(t).unwrap_err().to_string().contains("RAK_DIST_LISTEN_FD=\"-1\" is not a file descriptor"));
        set(&[("RAK_DIST_LISTEN_FD", None)]);
        set(&[("TORCHELASTIC_USE_AGENT_STORE", Some("True")), ("MASTER_ADDR", Some("10.0.0.2")), ("TORCHELASTIC_RESTART_COUNT", Some("3"))]);
        let r = Rendezvous::from_env(t).unwrap().unwrap();
        assert!(r.store_is_client && r.host == "10.0.0.2" && r.bind.is_empty() && r.prefix == "rak/3", "{r:?}");
        set(&[("GLOO_SOCKET_IFNAME", Some("eth1"))]);
        assert_eq!(Rendezvous::from_env(t).unwrap().unwrap().bind, "iface:eth1");
        set(&[("RANK", Some("2"))]);
        assert!(Rendezvous::from_env(t).unwrap_err().to_string().contains("rank 2 of a world of 2"));
        set(&[("RANK", None)]);
        assert!(Rendezvous::from_env(t).unwrap_err().to_string().contains("RANK is not"));
        set(&[("RANK", Some("0")), ("MASTER_PORT", Some("x"))]);
        assert!(Rendezvous::from_env(t).unwrap_err().to_string().contains("MASTER_PORT=\"x\""));
        set(&[("WORLD_SIZE", None), ("RANK", None), ("MASTER_ADDR", None), ("MASTER_PORT", None), ("TORCHELASTIC_USE_AGENT_STORE", None), ("GLOO_SOCKET_IFNAME", None), ("TORCHELASTIC_RESTART_COUNT", None), ("RAK_DIST_LISTEN_FD", None)]);
    }
}
