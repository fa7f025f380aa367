//! `host train`: multitask dense-retriever training in the style of Hugging Face's Trainer.
//! A TOML recipe (`--config`, `rak_train::recipe`) gives the data, model and
//! hyper-parameters; flags override it; `rak_train::run` does the rest.
//!
//! Data-parallel: `--nproc N` starts N copies of the command on this machine, each told its
//! rank by the variables torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`); a command started with them (by `--nproc`, torchrun or a scheduler) joins
//! its group. Rank 0 prints the summary and shows progress; a rank that fails stops the rest.

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::dist::Rendezvous;
use rak_core::plugin::{Encoder, Optimizer};
use rak_train::recipe::read_recipe;
use rak_train::run::{Plugins, Resume, RunSpec};
use rak_retrieval::pipeline::Progress;
use serde_json::Value;
use std::path::PathBuf;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Encoder plugin (dpr, taser, taco, ...); default: the recipe's.
    #[arg(long)]
    pub encoder: Option<String>,
    /// Starting checkpoint: a folder, a Hugging Face Hub id or a known bare name; default: the
    /// recipe's `[model] path`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The branch, tag or commit of a Hub `--model` (default: main), or of the recipe's
    /// `[model] path` without `--model` (default: the recipe's `[model] revision`, else main).
    /// The recipe's revision never applies to a `--model`.
    #[arg(long)]
    pub revision: Option<String>,
    /// Optimizer plugin (adamw, tsage, ...); default: the recipe's. A stage override that
    /// names an optimizer keeps it for its stages.
    #[arg(long)]
    pub optim: Option<String>,
    /// The TOML recipe.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where checkpoints, the log and the final model go.
    #[arg(long)]
    pub output_dir: PathBuf,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop after this many optimizer steps (overrides the number of epochs).
    #[arg(long)]
    pub max_steps: Option<u64>,
    #[arg(long)]
    pub num_train_epochs: Option<f64>,
    #[arg(long)]
    pub learning_rate: Option<f64>,
    /// Queries per step over all tasks (one process).
    #[arg(long)]
    pub per_device_train_batch_size: Option<usize>,
    /// A checkpoint directory, or `latest` (the newest under --output-dir).
    #[arg(long)]
    pub resume_from_checkpoint: Option<String>,
    /// Start afresh in an --output-dir that holds an earlier run's checkpoints (they are removed).
    #[arg(long)]
    pub overwrite_output_dir: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Mixed precision: float32 weights and optimizer state, the forward pass under bf16
    /// autocast (as Hugging Face's Trainer with `bf16=True`), on the CPU or a GPU.
    #[arg(long)]
    pub bf16: bool,
    /// After the BM25-negative stage, this many ANCE episodes: mine negatives with the model
    /// so far over the whole corpus, then train again (default: the recipe's, else 0).
    #[arg(long)]
    pub ance_episodes: Option<u32>,
    /// Train data-parallel in this many processes on this machine (`--per-device-train-batch-size`
    /// queries each, negatives shared across them), as `torchrun --nproc-per-node N` would.
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
}

/// How long a process waits for the others (the rendezvous, every collective) before it gives
/// up; a process that dies is noticed at once. Not what the others wait for rank 0 to do alone
/// (mining negatives, saving a stage's model): that has no bound but rank 0's life
/// (`ProcessGroup::after_lead`). RAK_DIST_TIMEOUT_S changes it.
fn dist_timeout() -> Result<Duration> {
    match std::env::var("RAK_DIST_TIMEOUT_S") {
        Ok(v) => Ok(Duration::from_secs(v.parse().map_err(|_| anyhow::anyhow!("RAK_DIST_TIMEOUT_S={v:?} is not a number of seconds"))?)),
        Err(_) => Ok(Duration::from_secs(30 * 60)),
    }
}

pub fn run(registry: &Registry, args: &TrainArgs) -> Result<Value> {
    let rendezvous = Rendezvous::from_env(dist_timeout()?)?;
    if args.nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    if args.nproc > 1 {
        if let Some(r) = &rendezvous {
            bail!("--nproc {} inside a launched group (RANK {} of WORLD_SIZE {}): let the launcher start the processes", args.nproc, r.rank, r.world);
        }
        return launch(args.nproc);
    }
    let Some(config_path) = &args.config else { bail!("--config FILE.toml is required (see configs/minikilt/)") };
    let mut recipe = read_recipe(config_path)?;
    let t = &mut recipe.train;
    if let Some(v) = args.seed {
        t.seed = v;
    }
    if let Some(v) = args.learning_rate {
        t.learning_rate = v;
    }
    if let Some(v) = args.per_device_train_batch_size {
        t.per_device_train_batch_size = v;
    }
    if let Some(v) = args.num_train_epochs {
        t.num_train_epochs = v;
    }
    if args.max_steps.is_some() {
        t.max_steps = args.max_steps;
    }
    if let Some(v) = args.ance_episodes {
        t.ance_episodes = v;
    }
    // Before any work (the model may be fetched from the Hub below).
    recipe.validate()?;
    let device = process_device(&args.device, rendezvous.as_ref())?;
    let rendezvous = rendezvous.map(|r| with_backend(r, &args.device)).transpose()?;
    let spec = RunSpec {
        encoder: args.encoder.clone().or(recipe.model.encoder.clone()).context("no encoder: give --encoder or model.encoder")?,
        optim: args.optim.clone().or(recipe.train.optim.clone()).context("no optimizer: give --optim or train.optim")?,
        model: {
            // The recipe's revision goes with the recipe's model only.
            let (model, revision) = recipe.model.choose(args.model.as_deref(), args.revision.as_deref()).context("no model: give --model or model.path")?;
            if let (Some(given), Some(pinned), None) = (&args.model, &recipe.model.revision, &args.revision) {
                eprintln!(
                    "host train: note: the recipe's [model] revision {pinned:?} is for its [model] path, not for --model {}: left out",
                    given.display()
                );
            }
            super::encode::resolve_model(&model, revision.as_deref(), "host train")?
        },
        recipe,
        output_dir: args.output_dir.clone(),
        device,
        bf16: args.bf16,
        resume: Resume::parse(args.resume_from_checkpoint.as_deref()),
        overwrite: args.overwrite_output_dir,
        examples: None,
        rendezvous: rendezvous.clone(),
    };
    match &rendezvous {
        Some(r) if r.rank != 0 => {
            rak_train::run::run(&spec, registry, &Silent)?;
            Ok(Value::Null)
        }
        _ => rak_train::run::run(&spec, registry, &Bar::default()),
    }
}

/// Whether a data-parallel run's CUDA tensors go over NCCL: `RAK_DIST_BACKEND` `gloo` or
/// `nccl`, else NCCL when this build has it and `--device` is plain `cuda`, which gives each
/// process its own GPU (`cuda:LOCAL_RANK`); `cuda:N` may put several on one GPU, which NCCL
/// refuses, so it stays on Gloo. CPU tensors and barriers always go over Gloo.
fn with_backend(mut r: Rendezvous, device: &str) -> Result<Rendezvous> {
    let cuda = device.starts_with("cuda");
    r.nccl = match std::env::var("RAK_DIST_BACKEND").ok().as_deref() {
        None | Some("") => device == "cuda" && rak_core::dist::nccl_available(),
        Some("gloo") => false,
        Some("nccl") if !rak_core::dist::nccl_available() => {
            bail!("RAK_DIST_BACKEND=nccl: this build has no NCCL (the CUDA and NCCL headers were not found when it was built)")
        }
        Some("nccl") if !cuda => bail!("RAK_DIST_BACKEND=nccl needs --device cuda (NCCL carries CUDA tensors only)"),
        Some("nccl") => true,
        Some(other) => bail!("RAK_DIST_BACKEND={other:?}: expected gloo or nccl"),
    };
    Ok(r)
}

/// `cuda` in a data-parallel run is the GPU of this process's `LOCAL_RANK` (its rank when
/// unset), as torchrun's processes each take one; `cuda:N` and `cpu` stay as given.
fn process_device(device: &str, rendezvous: Option<&Rendezvous>) -> Result<String> {
    let Some(r) = rendezvous.filter(|_| device == "cuda") else { return Ok(device.to_string()) };
    let local = match std::env::var("LOCAL_RANK") {
        Ok(v) => v.parse::<usize>().map_err(|_| anyhow::anyhow!("LOCAL_RANK={v:?} is not a whole number"))?,
        Err(_) => r.rank,
    };
    Ok(format!("cuda:{local}"))
}

/// The progress of a process other than rank 0: nothing (rank 0 shows the run's; an error
/// still reaches the user through the command's exit).
struct Silent;

impl Progress for Silent {
    fn log(&self, _line: &str) {}
}

/// `--nproc N`: this command line again in N processes on 127.0.0.1, each with its rank in
/// the launch variables; waits for them all. Rank 0's summary is the command's; when a
/// process fails, the error names it (the first to fail, not the others that failed because
/// it did) and the others are stopped ([`stop`]).
fn launch(n: usize) -> Result<Value> {
    // The store's socket is bound here, to loopback only, and handed to rank 0
    // (RAK_DIST_LISTEN_FD), whose store serves on it: libtorch's store would listen on every
    // interface, and on a port probed free here and bound later, which another program may
    // take in between.
    let store = std::net::TcpListener::bind("127.0.0.1:0").context("cannot listen on 127.0.0.1 for the rendezvous")?;
    let port = store.local_addr().context("the rendezvous socket's port")?.port();
    let store_fd = std::os::fd::AsRawFd::as_raw_fd(&store);
    // The same arguments without --nproc (as `--nproc N` or `--nproc=N`).
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut given = std::env::args_os().skip(1);
    while let Some(a) = given.next() {
        if a == "--nproc" {
            given.next();
        } else if !a.to_string_lossy().starts_with("--nproc=") {
            args.push(a);
        }
    }
    let exe = std::env::current_exe().context("cannot find this program to start its copies")?;
    // One thread per process waits on it and reports its exit here, so the exits arrive in
    // the order they happened: polling the processes in rank order named whichever came first
    // in that order among those found dead together, often a rank that only failed because
    // another had died.
    let (exits, exited) = std::sync::mpsc::channel();
    let mut running: Vec<Option<u32>> = Vec::with_capacity(n);
    let mut rank_0_output = None;
    for rank in 0..n {
        let mut child = Command::new(&exe);
        child
            .args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("RAK_DIST_LISTEN_FD")
            .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() });
        if rank == 0 {
            child.env("RAK_DIST_LISTEN_FD", store_fd.to_string());
        }
        // Every process is on this machine: NCCL's bootstrap sockets (CUDA runs) stay on
        // loopback too, instead of the first other interface NCCL would pick.
        if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
            child.env("NCCL_SOCKET_IFNAME", "lo");
        }
        // SAFETY: only an async-signal-safe call between fork and exec: the process dies with
        // this thread (the launcher's main thread, which outlives every wait), so a launcher
        // that is killed leaves no process training on.
        let child = unsafe {
            child.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Rank 0 keeps the store's socket across exec (it is close-on-exec here, so
                // no other process gets it).
                if rank == 0 && libc::fcntl(store_fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        }
        .spawn();
        let mut child: Child = match child {
            Ok(c) => c,
            Err(e) => {
                let _ = stop(&mut running, &exited, STOP_GRACE);
                bail!("cannot start process {rank} of {n}: {e}");
            }
        };
        if rank == 0 {
            rank_0_output = child.stdout.take();
        }
        running.push(Some(child.id()));
        let exits = exits.clone();
        std::thread::spawn(move || {
            let status = child.wait();
            let _ = exits.send((rank, status));
        });
    }
    drop(exits);
    // Rank 0 has its own copy: once it exits, the port refuses connections.
    drop(store);
    // Rank 0's summary, read while it runs (a full pipe would stall it).
    let mut out = rank_0_output.context("rank 0's output")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut out, &mut text).map(|_| text)
    });
    while running.iter().any(Option::is_some) {
        let (rank, status) = exited.recv().context("lost track of the processes")?;
        running[rank] = None;
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                let _ = stop(&mut running, &exited, STOP_GRACE);
                bail!("process {rank} of {n} failed ({s}); the other processes were stopped");
            }
            Err(e) => {
                let _ = stop(&mut running, &exited, STOP_GRACE);
                bail!("process {rank} of {n}: {e}; the other processes were stopped");
            }
        }
    }
    let text = reader.join().map_err(|_| anyhow::anyhow!("reading rank 0's output failed"))?.context("rank 0's output")?;
    serde_json::from_str(&text).with_context(|| format!("rank 0's summary is not JSON: {text:?}"))
}

/// How long the other processes of a failed run get to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Stop the processes still `running` (by id; `None` once their exit was reported on
/// `exited`): SIGTERM, then SIGKILL to those that have not exited within `grace`, so that a
/// process can still end cleanly (release its GPU, close its files) but none can hold the
/// launcher up. Returns when every one has exited. An id is signalled only before its exit
/// was reported: until its waiting thread reaps it, the id cannot be reused. Returns the exits
/// it saw, by rank.
fn stop(running: &mut [Option<u32>], exited: &Exits, grace: Duration) -> Vec<(usize, std::io::Result<std::process::ExitStatus>)> {
    let mut seen = Vec::new();
    let signal = |running: &[Option<u32>], sig: libc::c_int| {
        for pid in running.iter().flatten() {
            // SAFETY: a signal to a child of this process that has not been reaped.
            unsafe { libc::kill(*pid as libc::pid_t, sig) };
        }
    };
    // Exits already reported are taken first, so that none of their ids is signalled.
    while let Ok((rank, status)) = exited.try_recv() {
        running[rank] = None;
        seen.push((rank, status));
    }
    signal(running, libc::SIGTERM);
    let deadline = std::time::Instant::now() + grace;
    while running.iter().any(Option::is_some) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match exited.recv_timeout(left) {
            Ok((rank, status)) => {
                running[rank] = None;
                seen.push((rank, status));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return seen,
        }
    }
    signal(running, libc::SIGKILL);
    while running.iter().any(Option::is_some) {
        match exited.recv() {
            Ok((rank, status)) => {
                running[rank] = None;
                seen.push((rank, status));
            }
            Err(_) => break,
        }
    }
    seen
}

/// Where each process's waiting thread reports its exit: (rank, status).
type Exits = std::sync::mpsc::Receiver<(usize, std::io::Result<std::process::ExitStatus>)>;

impl Plugins for Registry {
    fn encoder(&self, name: &str, settings: &Value) -> Result<Box<dyn Encoder>> {
        Registry::encoder(self, name, settings)
    }
    fn optimizer(&self, name: &str, settings: &Value) -> Result<Box<dyn Optimizer>> {
        Registry::optimizer(self, name, settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    /// Processes watched as `launch` watches its ranks.
    fn watched(scripts: &[&str]) -> (Vec<Option<u32>>, Exits) {
        let (exits, exited) = std::sync::mpsc::channel();
        let mut running = Vec::new();
        for (rank, script) in scripts.iter().enumerate() {
            let mut child = Command::new("sh").args(["-c", script]).spawn().unwrap();
            running.push(Some(child.id()));
            let exits = exits.clone();
            std::thread::spawn(move || {
                let _ = exits.send((rank, child.wait()));
            });
        }
        (running, exited)
    }

    /// The others of a failed run get SIGTERM and a grace period; one that ignores it is
    /// killed once the grace period is over.
    #[test]
    fn stop_sends_sigterm_then_sigkill_after_the_grace_period() {
        // An ignored signal stays ignored across exec: the second sleep ignores SIGTERM.
        let (mut running, exited) = watched(&["exec sleep 30", "trap '' TERM; exec sleep 30"]);
        std::thread::sleep(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let mut seen = stop(&mut running, &exited, Duration::from_secs(1));
        let took = started.elapsed();
        seen.sort_by_key(|(rank, _)| *rank);
        let signals: Vec<Option<i32>> = seen.iter().map(|(_, s)| s.as_ref().unwrap().signal()).collect();
        assert_eq!(signals, [Some(libc::SIGTERM), Some(libc::SIGKILL)], "{seen:?}");
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(10), "stopped in {took:?}");
        assert!(running.iter().all(Option::is_none));
        // Without a process that ignores SIGTERM, no wait for the grace period.
        let (mut running, exited) = watched(&["exec sleep 30"]);
        std::thread::sleep(Duration::from_millis(100));
        let started = std::time::Instant::now();
        stop(&mut running, &exited, Duration::from_secs(20));
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }
}
