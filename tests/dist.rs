//! c10d process groups (`rak_core::dist`) on loopback: two real processes, this test binary
//! run a second time as rank 1 (`RAK_DIST_TEST_CHILD` names the test it plays).
use rak_core::dist::{ProcessGroup, Rendezvous, AVAILABLE};
use rak_core::tch::{Kind, Tensor};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const CHILD: &str = "RAK_DIST_TEST_CHILD";
const PORT: &str = "RAK_DIST_TEST_PORT";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn rendezvous(port: u16, rank: usize, timeout: Duration) -> Rendezvous {
    Rendezvous { host: "127.0.0.1".into(), port, listen_fd: None, rank, world: 2, store_is_client: false, bind: "127.0.0.1".into(), prefix: "test".into(), timeout, nccl: false }
}

/// Rank 1: this binary again, running only `test` with the child's variables set.
fn spawn_rank_1(test: &str, port: u16) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, test)
        .env(PORT, port.to_string())
        .spawn()
        .unwrap()
}

/// `Some(port)` when this process is the child playing rank 1 of `test`.
fn as_child(test: &str) -> Option<u16> {
    (std::env::var(CHILD).ok().as_deref() == Some(test)).then(|| std::env::var(PORT).unwrap().parse().unwrap())
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

fn collectives(rank: usize, port: u16) {
    let mut g = ProcessGroup::join(&rendezvous(port, rank, Duration::from_secs(60))).unwrap();
    assert_eq!((g.rank(), g.world()), (rank, 2));
    let r = rank as f32;
    // Sum: one tensor, then two coalesced of different shapes.
    let a = Tensor::full([3], (r + 1.0) as f64, (Kind::Float, rak_core::tch::Device::Cpu));
    g.all_reduce_sum(&[&a]).unwrap();
    assert_eq!(values(&a), vec![3.0; 3]);
    let b = Tensor::from_slice(&[r, 2.0 * r]);
    let c = Tensor::from_slice(&[10.0 * r, 1.0, 2.0, 3.0]).view([2, 2]);
    g.all_reduce_sum(&[&b, &c]).unwrap();
    assert_eq!(values(&b), vec![1.0, 2.0]);
    assert_eq!(values(&c), vec![10.0, 2.0, 4.0, 6.0]);
    // Gather, in rank order.
    let mine = Tensor::from_slice(&[r, r + 0.5]).view([1, 2]);
    let all = g.all_gather(&mine).unwrap();
    assert_eq!(all.iter().map(values).collect::<Vec<_>>(), vec![vec![0.0, 0.5], vec![1.0, 1.5]]);
    // Broadcast from rank 1.
    let t = Tensor::from_slice(&[r * 7.0]);
    g.broadcast(&t, 1).unwrap();
    assert_eq!(values(&t), vec![7.0]);
    g.barrier().unwrap();
}

/// Runs `body` as rank 0 here and as rank 1 in a copy of this test binary that runs only
/// `test`; both must succeed.
fn on_two_ranks(test: &str, body: fn(usize, u16)) {
    assert!(AVAILABLE, "this build has no c10d shim: apt install libgloo-dev (scripts/install.sh does), cargo clean -p rak-torch-shim and rebuild");
    if let Some(port) = as_child(test) {
        return body(1, port);
    }
    let port = free_port();
    let mut child = spawn_rank_1(test, port);
    body(0, port);
    assert!(child.wait().unwrap().success(), "rank 1 failed");
}

#[test]
fn collectives_across_two_processes() {
    on_two_ranks("collectives_across_two_processes", collectives);
}

#[test]
fn a_rank_that_dies_fails_the_others_within_the_timeout() {
    assert!(AVAILABLE, "this build has no c10d shim");
    const NAME: &str = "a_rank_that_dies_fails_the_others_within_the_timeout";
    let timeout = Duration::from_secs(10);
    if let Some(port) = as_child(NAME) {
        let _g = ProcessGroup::join(&rendezvous(port, 1, timeout)).unwrap();
        // Dies as a killed worker would: no collective, no clean leave.
        std::process::abort();
    }
    let port = free_port();
    let mut child = spawn_rank_1(NAME, port);
    let mut g = ProcessGroup::join(&rendezvous(port, 0, timeout)).unwrap();
    assert!(!child.wait().unwrap().success());
    let start = Instant::now();
    let err = g.all_reduce_sum(&[&Tensor::from_slice(&[1.0f32])]).unwrap_err().to_string();
    assert!(start.elapsed() < timeout + Duration::from_secs(5), "took {:?}", start.elapsed());
    assert!(err.contains("rank 0 of 2: all-reduce failed"), "{err}");
    eprintln!("{err}");
}

#[test]
fn a_missing_rank_fails_the_rendezvous_within_the_timeout() {
    assert!(AVAILABLE, "this build has no c10d shim");
    let start = Instant::now();
    let err = ProcessGroup::join(&rendezvous(free_port(), 0, Duration::from_secs(3))).err().expect("joined a group of 2 alone").to_string();
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(err.contains("rank 0 of 2: cannot join the group at 127.0.0.1:"), "{err}");
    eprintln!("{err}");
}

fn gather_and_reduce(rank: usize, port: u16) {
    let mut g = ProcessGroup::join(&rendezvous(port, rank, Duration::from_secs(60))).unwrap();
    let r = rank as f32;
    // Rank 0 has 2 rows, rank 1 has 3; a leaf per rank stands for its encoder's output.
    let rows = if rank == 0 { 2 } else { 3 };
    let leaf = Tensor::from_slice(&(0..rows * 2).map(|i| 10.0 * r + i as f32).collect::<Vec<_>>()).view([rows, 2]).set_requires_grad(true);
    let local = &leaf * 1.0;
    let (all, offset) = g.gather_rows(&local).unwrap();
    assert_eq!((all.size(), offset), (vec![5, 2], if rank == 0 { 0 } else { 2 }));
    assert_eq!(values(&all), vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);
    // The loss over every row reaches this rank's leaf through its own rows only.
    let weights = Tensor::from_slice(&(0..10).map(|i| i as f32).collect::<Vec<_>>()).view([5, 2]);
    (&all * &weights).sum(Kind::Float).backward();
    assert_eq!(values(&leaf.grad()), values(&weights.narrow(0, offset, rows)));
    // A rank with no rows takes part and gets every other row.
    let none = Tensor::zeros([0, 0], (Kind::Float, rak_core::tch::Device::Cpu));
    let (all, offset) = g.gather_rows(if rank == 0 { &none } else { &local }).unwrap();
    assert_eq!((all.size(), offset), (vec![3, 2], 0));
    // Gradients: `a` reached on both ranks, `b` on rank 1 only, `c` on neither.
    let params = [Tensor::zeros([2], (Kind::Float, rak_core::tch::Device::Cpu)), Tensor::zeros([3], (Kind::Float, rak_core::tch::Device::Cpu)), Tensor::zeros([1], (Kind::Float, rak_core::tch::Device::Cpu))];
    let grads = [Tensor::from_slice(&[1.0 + r, 2.0]), if rank == 1 { Tensor::from_slice(&[5.0f32, 6.0, 7.0]) } else { Tensor::new() }, Tensor::new()];
    let summed = g.all_reduce_gradients(&params.iter().collect::<Vec<_>>(), &grads).unwrap();
    assert_eq!(values(&summed[0]), vec![3.0, 4.0]);
    assert_eq!(values(&summed[1]), vec![5.0, 6.0, 7.0]);
    assert!(!summed[2].defined());
}

#[test]
fn rows_gathered_keep_the_local_graph_and_gradients_sum() {
    on_two_ranks("rows_gathered_keep_the_local_graph_and_gradients_sum", gather_and_reduce);
}

/// A group joined with NCCL (compiled in where the CUDA and NCCL headers were found, as
/// scripts/install.sh provides): without a GPU, joining fails saying NCCL needs one; with
/// GPUs, CPU tensors' collectives still go over Gloo and CUDA tensors' over NCCL.
fn nccl_group(rank: usize, port: u16) {
    let mut r = rendezvous(port, rank, Duration::from_secs(60));
    r.nccl = true;
    if !rak_core::tch::Cuda::is_available() {
        let err = ProcessGroup::join(&r).err().expect("an NCCL group without a GPU").to_string();
        assert!(err.contains(&format!("rank {rank} of 2: cannot join")) && err.contains("GPU"), "{err}");
        eprintln!("{err}");
        return;
    }
    let mut g = ProcessGroup::join(&r).unwrap();
    let cpu = Tensor::from_slice(&[rank as f32 + 1.0]);
    g.all_reduce_sum(&[&cpu]).unwrap();
    assert_eq!(values(&cpu), vec![3.0]);
    // Two processes on one GPU are refused by NCCL; with several, each takes its own.
    if rak_core::tch::Cuda::device_count() > 1 {
        let cuda = cpu.to_device(rak_core::tch::Device::Cuda(rank));
        g.all_reduce_sum(&[&cuda]).unwrap();
        assert_eq!(values(&cuda.to_device(rak_core::tch::Device::Cpu)), vec![6.0]);
    }
    g.barrier().unwrap();
}

/// Whether the libtorch this process runs has CUDA: `libtorch_cuda.so` beside the loaded
/// `libtorch_cpu.so` (the torch wheel scripts/install.sh brings has it; a CPU-only libtorch has
/// no NCCL to build).
fn libtorch_has_cuda() -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let cpu = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.ends_with("/libtorch_cpu.so")).expect("libtorch_cpu.so is loaded");
    std::path::Path::new(cpu).with_file_name("libtorch_cuda.so").exists()
}

#[test]
fn an_nccl_group_is_built_in_and_leaves_cpu_tensors_to_gloo() {
    if !libtorch_has_cuda() {
        assert!(!rak_core::dist::nccl_available());
        eprintln!("a CPU-only libtorch: no NCCL to test");
        return;
    }
    assert!(rak_core::dist::nccl_available(), "this build has no NCCL: scripts/install.sh brings CUDA's headers, then rebuild");
    on_two_ranks("an_nccl_group_is_built_in_and_leaves_cpu_tensors_to_gloo", nccl_group);
}

/// A phase rank 0 runs alone (`after_lead`) may outlast the collective timeout: the others wait
/// for it however long it takes (a barrier gave up at the timeout), yet fail within seconds
/// when rank 0 dies (its process serves the store they ask). Here rank 0 is the child.
#[test]
fn a_wait_for_rank_0_outlasts_the_timeout_and_ends_when_rank_0_dies() {
    assert!(AVAILABLE, "this build has no c10d shim");
    const NAME: &str = "a_wait_for_rank_0_outlasts_the_timeout_and_ends_when_rank_0_dies";
    // Long enough for the rendezvous of two processes starting on a busy machine.
    let timeout = Duration::from_secs(8);
    if let Some(port) = as_child(NAME) {
        let mut g = ProcessGroup::join(&rendezvous(port, 0, timeout)).unwrap();
        // Work alone for more than twice the timeout, then die in the next phase.
        std::thread::sleep(timeout * 5 / 2);
        g.after_lead("work", &mut |_| {}).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        std::process::abort();
    }
    let port = free_port();
    let mut child = spawn_rank_1(NAME, port);
    let mut g = ProcessGroup::join(&rendezvous(port, 1, timeout)).unwrap();
    let start = Instant::now();
    g.after_lead("work", &mut |_| {}).unwrap();
    assert!(start.elapsed() >= timeout * 2, "rank 0 was done after {:?}", start.elapsed());
    let start = Instant::now();
    let err = g.after_lead("die", &mut |_| {}).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?} to notice", start.elapsed());
    assert!(err.contains("rank 1 of 2: rank 0 is gone") && err.contains("waiting for it to die"), "{err}");
    eprintln!("{err}");
    assert!(!child.wait().unwrap().success());
}
