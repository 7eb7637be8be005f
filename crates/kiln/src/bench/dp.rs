//! Data-parallel transport rows: one all-reduce (mean) of a gradient-sized buffer between two
//! worker processes on this machine, as the trainer runs it every step. The PyTorch side is
//! `torch.distributed.all_reduce` on the gloo backend (scripts/bench_reference.py), what
//! `torchrun` + DDP uses on CPU.
//!
//! The row's process is rank 0; it starts rank 1 by running itself again (same arguments) with the
//! torchrun variables set, which makes that copy a silent worker.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::tensor::{Shape, Tensor, TensorPrimitive};

use super::rows::StepWork;
use super::BenchResult;
use crate::backend::Cpu;
use crate::models::mlp;
use crate::ops::KilnBackend;
use crate::parallel::launch::{worker_env, LaunchOptions};
use crate::parallel::{DistEnv, ProcessGroup};
use crate::{KilnError, Result};

/// Values in the MNIST MLP's gradient plus the step's loss: what the MNIST sample all-reduces per
/// step.
pub fn mnist_gradient_len() -> usize {
    let (i, h1, h2, o) = (mlp::INPUT, 120, 84, mlp::CLASSES);
    i * h1 + h1 + h1 * h2 + h2 + h2 * o + o + 1
}

/// Times `steps` all-reduces of `elements` f32 values after `warmup` untimed ones, on two
/// processes; `name` is the row's result name.
pub fn allreduce(name: &str, elements: usize, warmup: usize, steps: usize) -> Result<BenchResult> {
    let device = Default::default();
    let timeout = Duration::from_secs(120);
    if let Some(env) = DistEnv::from_env()? {
        // The copy rank 0 started: take part, report nothing.
        let group = ProcessGroup::<Cpu>::init(env, &device, timeout)?;
        run_steps(&group, elements, warmup + steps)?;
        return Ok(BenchResult::from_times(name, &[], &[]));
    }
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
        args: Vec::new(),
    };
    let rank0: HashMap<_, _> = worker_env(&launch, 0).into_iter().collect();
    let env =
        DistEnv::from_lookup(|k| rank0.get(k).cloned())?.expect("two workers are distributed");
    let mut peer = Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .envs(worker_env(&launch, 1))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| KilnError::io(&exe, e))?;
    let times = {
        let group = ProcessGroup::<Cpu>::init(env, &device, timeout)?;
        run_steps(&group, elements, warmup + steps)?
    };
    let status = peer.wait().map_err(|e| KilnError::io(&exe, e))?;
    if !status.success() {
        return Err(KilnError::Distributed(format!(
            "benchmark {name}: the rank 1 process failed ({status})"
        )));
    }
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

/// Runs `n` all-reduces of a fresh buffer (as each training step flattens a fresh gradient) and
/// returns the seconds each took.
fn run_steps(group: &ProcessGroup<Cpu>, elements: usize, n: usize) -> Result<Vec<f64>> {
    let device = Default::default();
    let mut times = Vec::with_capacity(n);
    for step in 0..n {
        let values = vec![(group.rank() + step) as f32; elements];
        let t = Cpu::kiln_from_host(values, Shape::new([elements]), &device);
        let start = Instant::now();
        let reduced = group.all_reduce_mean(t)?;
        times.push(start.elapsed().as_secs_f64());
        // Every rank gets the mean of (rank + step) over ranks 0 and 1.
        let reduced = Tensor::<Cpu, 1>::from_primitive(TensorPrimitive::Float(reduced));
        let expected = step as f32 + 0.5;
        let values: Vec<f32> = reduced.into_data().to_vec().unwrap_or_default();
        if values.len() != elements || values.iter().any(|&v| v != expected) {
            return Err(KilnError::Distributed(format!(
                "all-reduce step {step}: expected {elements} values of {expected}"
            )));
        }
    }
    Ok(times)
}

/// A port `p` with `p + 1` and `p + 2` free too (rendezvous and the two tensor services).
fn free_port_pair() -> Result<u16> {
    for _ in 0..20 {
        let p = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| KilnError::Distributed(format!("no free port: {e}")))?
            .port();
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if p < 65533 && free(p + 1) && free(p + 2) {
            return Ok(p);
        }
    }
    Err(KilnError::Distributed(
        "no three consecutive free ports".into(),
    ))
}
