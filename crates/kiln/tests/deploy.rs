//! The Kubernetes manifests set exactly the contract `kiln launch` and its workers read: for every
//! pod of the Indexed Job, the launch flags (with the pod's environment expanded) give workers whose
//! environment [`DistEnv`] accepts, with distinct ranks covering the world, the rendezvous on pod 0
//! through the headless Service, and ports the Service exposes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kiln::parallel::launch::{worker_env, LaunchOptions};
use kiln::parallel::DistEnv;
use kiln_testkit::common;
use serde_yaml_ng::Value;

fn docs() -> Vec<Value> {
    let path = common::repo_root().join("deploy/k8s/kiln-job.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// Expands `"$VAR"` / `$VAR` the way the pod's shell does, then splits on whitespace.
fn shell_words(cmd: &str, env: &BTreeMap<String, String>) -> Vec<String> {
    cmd.split_whitespace()
        .map(|w| {
            let w = w.trim_matches('"');
            match w.strip_prefix('$') {
                Some(var) => env
                    .get(var)
                    .unwrap_or_else(|| panic!("${var} unset in the pod"))
                    .clone(),
                None => w.to_string(),
            }
        })
        .collect()
}

#[test]
fn manifests_set_the_launcher_contract() {
    let docs = docs();
    let svc = docs
        .iter()
        .find(|d| s(&d["kind"]) == "Service")
        .expect("a Service");
    let job = docs.iter().find(|d| s(&d["kind"]) == "Job").expect("a Job");
    assert_eq!(
        s(&svc["spec"]["clusterIP"]),
        "None",
        "the Service must be headless"
    );
    let spec = &job["spec"];
    assert_eq!(s(&spec["completionMode"]), "Indexed");
    let pod = &spec["template"];
    let app = s(&pod["metadata"]["labels"]["app"]);
    assert_eq!(
        s(&svc["spec"]["selector"]["app"]),
        app,
        "Service selects the pods"
    );
    assert_eq!(s(&pod["spec"]["subdomain"]), s(&svc["metadata"]["name"]));
    let container = &pod["spec"]["containers"][0];
    let mut env: BTreeMap<String, String> = container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|e| e.get("value").is_some())
        .map(|e| (s(&e["name"]), s(&e["value"])))
        .collect();
    let from_pod_ip = container["env"].as_sequence().unwrap().iter().any(|e| {
        s(&e["name"]) == "KILN_NODE_ADDR"
            && s(&e["valueFrom"]["fieldRef"]["fieldPath"]) == "status.podIP"
    });
    assert!(from_pod_ip, "KILN_NODE_ADDR must be the pod IP");
    let nnodes: usize = env["NNODES"].parse().unwrap();
    assert_eq!(s(&spec["completions"]).parse::<usize>().unwrap(), nnodes);
    assert_eq!(s(&spec["parallelism"]).parse::<usize>().unwrap(), nnodes);
    assert_eq!(
        env["MASTER_ADDR"],
        format!(
            "{}-0.{}",
            s(&job["metadata"]["name"]),
            s(&svc["metadata"]["name"])
        ),
        "the rendezvous is pod 0 through the headless Service"
    );
    let exposed: BTreeSet<u16> = svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| s(&p["port"]).parse().unwrap())
        .collect();

    let script = s(&container["args"][0]);
    let mut ranks = BTreeSet::new();
    for index in 0..nnodes {
        env.insert("JOB_COMPLETION_INDEX".into(), index.to_string());
        let words = shell_words(&script, &env);
        assert_eq!(&words[..3], ["exec", "kiln", "launch"]);
        let flag = |name: &str| {
            let i = words
                .iter()
                .position(|w| w == name)
                .unwrap_or_else(|| panic!("{name} missing"));
            words[i + 1].clone()
        };
        let dashes = words
            .iter()
            .position(|w| w == "--")
            .expect("-- before the worker command");
        assert_eq!(words[dashes + 1], "train");
        let opts = LaunchOptions {
            nproc_per_node: flag("--nproc-per-node").parse().unwrap(),
            nnodes: flag("--nnodes").parse().unwrap(),
            node_rank: flag("--node-rank").parse().unwrap(),
            master_addr: flag("--master-addr"),
            master_port: flag("--master-port").parse().unwrap(),
            node_addr: None,
            timeout: Duration::from_secs(flag("--timeout").parse().unwrap()),
            program: "kiln".into(),
            args: words[dashes + 1..].to_vec(),
            ..LaunchOptions::default()
        };
        assert_eq!(opts.node_rank, index);
        for local in 0..opts.nproc_per_node {
            let mut worker: BTreeMap<String, String> = worker_env(&opts, local, 0)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            worker.insert("KILN_NODE_ADDR".into(), format!("10.0.0.{index}"));
            let d = DistEnv::from_lookup(|k| worker.get(k).cloned())
                .unwrap()
                .expect("distributed");
            assert_eq!(d.world_size, nnodes * opts.nproc_per_node);
            assert_eq!(d.master_addr, env["MASTER_ADDR"]);
            assert_eq!(d.node_addr, format!("10.0.0.{index}"));
            assert!(
                exposed.contains(&d.master_port),
                "rendezvous port not in the Service"
            );
            assert!(
                exposed.contains(&d.data_port(d.rank)),
                "worker port {} not in the Service",
                d.data_port(d.rank)
            );
            assert!(ranks.insert(d.rank), "rank {} given twice", d.rank);
        }
    }
    let world = ranks.len();
    assert_eq!(
        ranks,
        (0..world).collect(),
        "ranks cover the world exactly once"
    );
}
