//! The MNIST MLP sample on real MNIST: the sample's output lines, a checkpoint, and an accuracy a
//! working MLP reaches (chance is 0.1).

mod kiln_bin;

use kiln_bin::kiln;
use kiln_testkit::common::asset;

/// The number on the output line that starts with `prefix`.
fn value_after(output: &str, prefix: &str) -> f64 {
    output
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in: {output}"))
        .parse()
        .unwrap()
}

#[test]
fn mnist_mlp_trains_prints_the_sample_lines_and_evaluates() {
    let Some(data) = asset("mnist/train-images-idx3-ubyte") else {
        return;
    };
    let data = data.parent().unwrap().to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mlp");
    let run = |args: &[&str]| {
        let o = kiln()
            .args(args)
            .arg("--data-dir")
            .arg(&data)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    // One epoch of the sample's four keeps the test short.
    let train = run(&[
        "train",
        "--task",
        "mnist-mlp",
        "--num-train-epochs",
        "1",
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(train.contains("Train throughput (iter/sec): "), "{train}");
    let loss = value_after(&train, "Final loss is ");
    assert!(loss.is_finite() && loss < 1.5, "final loss {loss}");
    assert!(train.contains("----------End Training ---------------"));
    assert!(out.join("model.safetensors").exists());
    let eval = run(&[
        "eval",
        "--task",
        "mnist-mlp",
        "--model",
        out.to_str().unwrap(),
    ]);
    assert!(eval.contains("Test throughput (iter/sec): "), "{eval}");
    let acc = value_after(&eval, "Accuracy: ");
    assert!(acc > 0.85, "accuracy after one epoch {acc}");
}
