//! Collective transport rows: one collective of a gradient-sized buffer between two worker
//! processes on this machine, as the trainer runs them every step — the data-parallel all-reduce
//! (mean), and the all-gather and reduce-scatter that ZeRO-1 and tensor parallelism use — on each
//! engine (Burn's, and MPI with `--features mpi`). The PyTorch side is `torch.distributed` on the
//! gloo backend (scripts/bench_reference.py), what `torchrun` + DDP uses on CPU.
//!
//! The row's process is rank 0 and starts rank 1 by running itself again (same arguments) with
//! the torchrun variables set, which makes that copy a silent worker; an MPI row instead runs
//! `mpirun` on two copies of itself and reads rank 0's result.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::tensor::{Shape, Tensor, TensorPrimitive};

use super::workloads::StepWork;
use super::BenchResult;
use crate::backend::Cpu;
use crate::models::mlp;
use crate::ops::KilnBackend;
use crate::parallel::launch::{worker_env, LaunchOptions};
use crate::parallel::{Collectives, DistEnv, Engine, ProcessGroup, ReduceOp};
use crate::{KilnError, Result};

/// Values in the MNIST MLP's gradient plus the step's loss: what the MNIST sample all-reduces per
/// step.
pub fn mnist_gradient_len() -> usize {
    let (i, h1, h2, o) = (mlp::INPUT, 120, 84, mlp::CLASSES);
    i * h1 + h1 + h1 * h2 + h2 + h2 * o + o + 1
}

/// The collective a row times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// All-reduce (mean) of the whole buffer.
    AllReduce,
    /// Each rank contributes half of the buffer; every rank gets all of it.
    AllGather,
    /// Each rank contributes the whole buffer; each gets its half of the sum.
    ReduceScatter,
}

/// Times `steps` collectives `op` over `elements` f32 values after `warmup` untimed ones, on two
/// processes and engine `engine`; `name` is the row's result name.
pub fn collective(
    name: &str,
    op: Op,
    engine: Engine,
    elements: usize,
    warmup: usize,
    steps: usize,
) -> Result<BenchResult> {
    let device = Default::default();
    let timeout = Duration::from_secs(120);
    let times = if DistEnv::from_env()?.is_some() {
        // A copy this row started (rank 1 of Burn's engine, or either rank under mpirun): take
        // part; only rank 0 reports.
        let joined = crate::parallel::init_from_env::<Cpu>(&device)?
            .ok_or_else(|| KilnError::Distributed("no job to join".into()))?;
        let times = run_steps(joined.world.as_ref(), op, elements, warmup + steps)?;
        if joined.env.rank != 0 {
            return Ok(BenchResult::from_times(name, &[], &[]));
        }
        times
    } else if engine == Engine::Mpi {
        return via_mpirun(name);
    } else {
        spawn_peer_and_run(name, op, elements, warmup + steps, timeout)?
    };
    let work = StepWork {
        samples: 1,
        padded_seq: 0,
        tokens: elements,
        flops: 0.0,
    };
    let mut r = BenchResult::from_times(name, &times[warmup..], &vec![work; steps]);
    r.batch = 2; // the world size
    Ok(r)
}

/// Burn's engine: this process is rank 0 and starts rank 1.
fn spawn_peer_and_run(
    name: &str,
    op: Op,
    elements: usize,
    n: usize,
    timeout: Duration,
) -> Result<Vec<f64>> {
    let device = Default::default();
    // The launcher's own contract for two workers on this machine: rank 0 is this process.
    let exe = std::env::current_exe().map_err(|e| KilnError::Distributed(e.to_string()))?;
    let launch = LaunchOptions {
        nproc_per_node: 2,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: free_port_pair()?,
        node_addr: None,
        timeout,
        program: exe.clone(),
        ..LaunchOptions::default()
    };
    let rank0: HashMap<_, _> = worker_env(&launch, 0, 0).into_iter().collect();
    let env =
        DistEnv::from_lookup(|k| rank0.get(k).cloned())?.expect("two workers are distributed");
    let mut peer = Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .envs(worker_env(&launch, 1, 0))
        .env("KILN_COLLECTIVES", "burn")
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| KilnError::io(&exe, e))?;
    let times = {
        let group = ProcessGroup::<Cpu>::init(env, &device, timeout)?;
        run_steps(&group, op, elements, n)?
    };
    let status = peer.wait().map_err(|e| KilnError::io(&exe, e))?;
    if !status.success() {
        return Err(KilnError::Distributed(format!(
            "benchmark {name}: the rank 1 process failed ({status})"
        )));
    }
    Ok(times)
}

/// MPI: runs this row on two copies of this process under `mpirun` and returns rank 0's result.
fn via_mpirun(name: &str) -> Result<BenchResult> {
    if !cfg!(feature = "mpi") {
        return Err(KilnError::Config(format!(
            "benchmark {name}: this kiln was built without MPI (build it with --features mpi)"
        )));
    }
    let exe = std::env::current_exe().map_err(|e| KilnError::Distributed(e.to_string()))?;
    let out = Command::new("mpirun")
        .args(["--oversubscribe", "-n", "2", "-x", "KILN_COLLECTIVES"])
        .arg(&exe)
        .args(std::env::args_os().skip(1))
        .env("KILN_COLLECTIVES", "mpi")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| {
            KilnError::Distributed(format!(
                "benchmark {name}: cannot run mpirun (Debian: openmpi-bin): {e}"
            ))
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let (results, _) = super::parse_results(&text);
    let result = results
        .into_iter()
        .filter(|_| out.status.success())
        .filter_map(|v| serde_json::from_value::<BenchResult>(v).ok())
        .find(|r| r.steps > 0);
    result.ok_or_else(|| {
        KilnError::Distributed(format!(
            "benchmark {name}: mpirun failed ({}): {text}",
            out.status
        ))
    })
}

/// Runs `n` collectives of a fresh buffer (as each training step flattens a fresh gradient),
/// checks each result, and returns the seconds each took.
fn run_steps(c: &dyn Collectives<Cpu>, op: Op, elements: usize, n: usize) -> Result<Vec<f64>> {
    let device = Default::default();
    let rank = c.rank();
    let half = elements / 2;
    let mut times = Vec::with_capacity(n);
    for step in 0..n {
        let len = if op == Op::AllGather { half } else { elements };
        let values = vec![(rank + step) as f32; len];
        let t = Tensor::<Cpu, 1>::from_primitive(TensorPrimitive::Float(Cpu::kiln_from_host(
            values,
            Shape::new([len]),
            &device,
        )));
        let start = Instant::now();
        let out = match op {
            Op::AllReduce => c.all_reduce(t, ReduceOp::Mean)?,
            Op::AllGather => c.all_gather(t)?,
            Op::ReduceScatter => c.reduce_scatter(t)?,
        };
        times.push(start.elapsed().as_secs_f64());
        // Ranks 0 and 1 contribute (rank + step): the mean is step + 0.5, the sum 2·step + 1,
        // and the gather holds step then step + 1.
        let values: Vec<f32> = out.into_data().to_vec().unwrap_or_default();
        let s = step as f32;
        let ok = match op {
            Op::AllReduce => values.len() == elements && values.iter().all(|&v| v == s + 0.5),
            Op::ReduceScatter => {
                values.len() == elements / 2 && values.iter().all(|&v| v == 2.0 * s + 1.0)
            }
            Op::AllGather => {
                values.len() == 2 * half
                    && values[..half].iter().all(|&v| v == s)
                    && values[half..].iter().all(|&v| v == s + 1.0)
            }
        };
        if !ok {
            return Err(KilnError::Distributed(format!(
                "{op:?} step {step}: wrong result on rank {rank}"
            )));
        }
    }
    Ok(times)
}

/// A port `p` with `p + 1` and `p + 2` free too (rendezvous and the two tensor services).
fn free_port_pair() -> Result<u16> {
    crate::parallel::launch::free_port_block("127.0.0.1", 2)
}
