//! Every collective of each engine (burn-collective; MPI with `--features mpi`) and of mesh
//! sub-groups, checked against a result each rank computes locally: four worker processes (this
//! test binary run again, by itself with the torchrun variables set or by `mpirun`) on a
//! 2 (TP) × 2 (DP) mesh.

#[cfg(feature = "mpi")]
use std::process::Command;

use burn::tensor::{Tensor, TensorData};
use kiln::backend::Cpu;
use kiln::parallel::{chunk_range, collectives::host, Collectives, DistEnv, Group, Mesh, ReduceOp};
use kiln_testkit::common;

const WORLD: usize = 4;

/// What rank `r` contributes to a collective: `n` values that differ per rank and position.
fn data(r: usize, n: usize, salt: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((r * 7 + i * 3) % 11) as f32 - 5.0 + salt * r as f32)
        .collect()
}

fn tensor(v: Vec<f32>) -> Tensor<Cpu, 1> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), &Default::default())
}

/// Checks every collective of `c`, whose members are the global ranks `members` (in order).
fn check_all(c: &dyn Collectives<Cpu>, members: &[usize], what: &str) {
    let me = members[c.rank()];
    assert_eq!(c.size(), members.len(), "{what}: size");
    let n = 37;
    let each: Vec<Vec<f32>> = members.iter().map(|&r| data(r, n, 0.25)).collect();
    let fold = |f: fn(f32, f32) -> f32| -> Vec<f32> {
        (0..n)
            .map(|i| each.iter().map(|v| v[i]).reduce(f).unwrap())
            .collect()
    };
    let sum = fold(|a, b| a + b);
    let max = fold(f32::max);
    let mean: Vec<f32> = sum.iter().map(|s| s / members.len() as f32).collect();

    let got = host(
        c.all_reduce(tensor(data(me, n, 0.25)), ReduceOp::Sum)
            .unwrap(),
    );
    assert_eq!(got, sum, "{what}: all-reduce sum");
    let got = host(
        c.all_reduce(tensor(data(me, n, 0.25)), ReduceOp::Max)
            .unwrap(),
    );
    assert_eq!(got, max, "{what}: all-reduce max");
    let got = host(
        c.all_reduce(tensor(data(me, n, 0.25)), ReduceOp::Mean)
            .unwrap(),
    );
    for (g, m) in got.iter().zip(&mean) {
        assert!((g - m).abs() <= 1e-6 * m.abs().max(1.0), "{what}: mean");
    }

    // Uneven gather: member i contributes i + 2 values.
    let counts: Vec<usize> = (0..members.len()).map(|i| i + 2).collect();
    let got = host(
        c.all_gather_v(tensor(data(me, counts[c.rank()], 1.0)), &counts)
            .unwrap(),
    );
    let want: Vec<f32> = members
        .iter()
        .zip(&counts)
        .flat_map(|(&r, &k)| data(r, k, 1.0))
        .collect();
    assert_eq!(got, want, "{what}: all-gather (uneven)");

    let got = host(c.reduce_scatter(tensor(data(me, n, 0.25))).unwrap());
    assert_eq!(
        got,
        sum[chunk_range(n, members.len(), c.rank())],
        "{what}: reduce-scatter"
    );

    let root = members.len() - 1;
    let got = host(c.broadcast(tensor(data(me, n, 2.0)), root).unwrap());
    assert_eq!(got, data(members[root], n, 2.0), "{what}: broadcast");

    // Point-to-point around the ring, both ways at once (a pipeline's activations forward and
    // gradients back), two messages each way, received in the order sent.
    c.open_links().unwrap();
    let k = members.len();
    let (next, prev) = ((c.rank() + 1) % k, (c.rank() + k - 1) % k);
    for salt in [3.0, 4.0] {
        c.send(tensor(data(me, n, salt)), next).unwrap();
        c.send(tensor(data(me, n + 1, -salt)), prev).unwrap();
    }
    for salt in [3.0, 4.0] {
        let got = host(c.recv(prev).unwrap());
        assert_eq!(got, data(members[prev], n, salt), "{what}: recv from prev");
        let got = host(c.recv(next).unwrap());
        assert_eq!(
            got,
            data(members[next], n + 1, -salt),
            "{what}: recv from next"
        );
    }

    c.barrier().unwrap();
}

fn worker() {
    let device = Default::default();
    let world = kiln::parallel::init_from_env::<Cpu>(&device)
        .unwrap()
        .expect("a worker of the job")
        .world;
    assert_eq!(world.size(), WORLD);
    check_all(world.as_ref(), &(0..WORLD).collect::<Vec<_>>(), "world");
    let mesh = Mesh::new(WORLD, 2, 1).unwrap();
    let tp = Group::new(world.clone(), mesh.tp_groups()).unwrap();
    let dp = Group::new(world.clone(), mesh.dp_groups()).unwrap();
    let (tp_members, dp_members) = (tp.members().to_vec(), dp.members().to_vec());
    // Every TP group runs its collectives at once, then every DP group.
    check_all(&tp, &tp_members, "tp group");
    check_all(&dp, &dp_members, "dp group");
    // Groups of one axis may carry payloads of different lengths (each DP group averages its own
    // tensor-parallel shard): each gets its own sum.
    let me = world.rank();
    let n = 5 + 3 * mesh.coords(me).tp;
    let got = host(
        dp.all_reduce(tensor(data(me, n, 0.5)), ReduceOp::Sum)
            .unwrap(),
    );
    let want: Vec<f32> = (0..n)
        .map(|i| dp_members.iter().map(|&r| data(r, n, 0.5)[i]).sum())
        .collect();
    assert_eq!(
        got, want,
        "dp group: payloads of different lengths per group"
    );
    check_all(
        &Group::world(world),
        &(0..WORLD).collect::<Vec<_>>(),
        "world group",
    );
}

#[test]
fn every_collective_equals_its_local_reference_on_the_world_and_mesh_groups() {
    if DistEnv::from_env().unwrap().is_some() {
        return worker();
    }
    common::run_test_ranks(
        "every_collective_equals_its_local_reference_on_the_world_and_mesh_groups",
        WORLD,
        &[("KILN_COLLECTIVES", "burn".to_string())],
    );
}

#[cfg(feature = "mpi")]
#[test]
fn every_mpi_collective_equals_its_local_reference_on_the_world_and_mesh_groups() {
    if DistEnv::from_env().unwrap().is_some() {
        return worker();
    }
    let exe = std::env::current_exe().unwrap();
    let status = Command::new("mpirun")
        .args(["--oversubscribe", "-n", &WORLD.to_string()])
        .arg(&exe)
        .args([
            "--exact",
            "every_mpi_collective_equals_its_local_reference_on_the_world_and_mesh_groups",
            "--nocapture",
        ])
        .env("KILN_COLLECTIVES", "mpi")
        // Containers and CI run as root, which Open MPI refuses without these.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .status()
        .expect("mpirun (Debian: openmpi-bin) runs");
    assert!(status.success(), "mpirun: {status}");
}
