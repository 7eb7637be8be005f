use burn::tensor::Tensor;
use kiln::backend::Cpu;
use kiln::parallel::ReduceOp;
fn main() {
    let device = Default::default();
    let g = kiln::parallel::init_from_env::<Cpu>(&device)
        .unwrap()
        .unwrap()
        .world;
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    for i in 0..200 {
        let n = sizes[i % sizes.len()];
        let t = Tensor::<Cpu, 1>::ones([n], &device) * (g.rank() as f32 + 1.0);
        let r = g.all_reduce(t, ReduceOp::Sum).unwrap();
        let v: Vec<f32> = r.into_data().into_vec().unwrap();
        assert_eq!(v[0], 3.0);
        eprintln!("op {i} n={n} ok");
    }
}
