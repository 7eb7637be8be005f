//! The rows `kiln bench` has, as one typed table: each row's key, what kiln runs with which
//! parameters ([`Work`]), where it runs ([`Devices`]), and the PyTorch rows it is compared with.

use super::dp::Op;
use crate::error::{KilnError, Result};
use crate::parallel::Engine;

/// What a row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// all-MiniLM-L6-v2 fine-tuned on 16 × 128 tokens, under `--bf16` or not.
    MiniLmTrain { bf16: bool },
    /// all-MiniLM-L6-v2's forward on 32 × 128 tokens.
    MiniLmInfer,
    /// BERT-base (from its config) trained on `batch` × 128 tokens, under `--bf16` or not.
    BertBaseTrain { batch: usize, bf16: bool },
    /// RoBERTa, DistilBERT or ModernBERT (the row's key) at BERT-base's size.
    EncoderFamilyTrain,
    /// The MNIST MLP.
    MnistTrain,
    /// MiniLM fine-tuned on the tweets CSV, data loading included.
    TweetsTrain,
    /// What publishing the live state for `kiln top` costs.
    LiveState,
    /// Qwen2 or Mistral (the row's key) at SmolLM2's size.
    DecoderFamilyTrain,
    /// SmolLM2-135M, converted from its GGUF, trained on the corpus.
    SmolLm2Train,
    /// SmolLM2-135M's shapes under `--bf16`, fully trained or a LoRA adapter on them.
    SmolLm2TrainBf16 { lora: bool },
    /// A LoRA adapter trained on SmolLM2's converted folder, or on a model of the row's config.
    LoraTrain { on_smollm2: bool },
    /// SmolLM2's prefill of the corpus.
    Prefill,
    /// SmolLM2 decoding token by token.
    Generate,
    /// One collective between two processes.
    Collective {
        op: Op,
        engine: Engine,
        elements: Elements,
    },
}

/// How many values a collective row moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elements {
    /// The MNIST MLP's gradient.
    MnistGradient,
    /// One gradient bucket ([`crate::parallel::BUCKET_ELEMENTS`]).
    Bucket,
}

/// Where a row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Devices {
    /// The CPU only (Llama rows and collectives time CPU paths).
    Cpu,
    /// The CPU, or a GPU beside PyTorch on the same GPU.
    CpuAndGpu,
    /// A GPU only (and only the GPU reference script has it).
    GpuOnly,
}

/// A benchmark row: what kiln runs and which PyTorch rows it is compared with.
#[derive(Debug)]
pub struct RowSpec {
    pub key: &'static str,
    /// What kiln runs, with its parameters.
    pub work: Work,
    /// Where the row runs.
    pub devices: Devices,
    /// Which reference script has the PyTorch side, and the names of its RESULT rows.
    pub reference: Reference,
    pub pytorch_rows: &'static [&'static str],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    /// ../shared/reference/bench_hf.py
    BenchHf,
    /// scripts/bench_reference.py (rows bench_hf.py does not have)
    Extra,
    /// kiln itself with a feature off (the row's [`BenchResult::baseline`]): the row measures
    /// what the feature costs, not kiln beside PyTorch.
    KilnBaseline,
}

pub const ROWS: &[RowSpec] = &[
    RowSpec {
        key: "minilm_train",
        work: Work::MiniLmTrain { bf16: false },
        devices: Devices::CpuAndGpu,
        reference: Reference::BenchHf,
        pytorch_rows: &["minilm_train_fp32"],
    },
    RowSpec {
        key: "minilm_train_bf16",
        work: Work::MiniLmTrain { bf16: true },
        devices: Devices::CpuAndGpu,
        reference: Reference::BenchHf,
        pytorch_rows: &["minilm_train_bf16_autocast"],
    },
    RowSpec {
        key: "minilm_infer",
        work: Work::MiniLmInfer,
        devices: Devices::CpuAndGpu,
        reference: Reference::BenchHf,
        pytorch_rows: &["minilm_infer_fp32"],
    },
    RowSpec {
        key: "bertbase_train",
        work: Work::BertBaseTrain {
            batch: 8,
            bf16: false,
        },
        devices: Devices::CpuAndGpu,
        reference: Reference::BenchHf,
        pytorch_rows: &["bertbase_train_fp32"],
    },
    // BERT-base under --bf16 at three batch sizes (issue 32's done-means): where launches and host
    // overhead decide (8, 32 sequences of 128) and where the kernels do (128). The larger two are
    // GPU only: on a CPU they are minutes per step. On a CPU the first is compared with autocast
    // in scripts/bench_reference.py (issue 56), which bench_hf.py lacks.
    RowSpec {
        key: "bertbase_train_bf16",
        work: Work::BertBaseTrain {
            batch: 8,
            bf16: true,
        },
        devices: Devices::CpuAndGpu,
        reference: Reference::Extra,
        pytorch_rows: &["bertbase_train_bf16_autocast"],
    },
    RowSpec {
        key: "bertbase_train_bf16_b32",
        work: Work::BertBaseTrain {
            batch: 32,
            bf16: true,
        },
        devices: Devices::GpuOnly,
        reference: Reference::BenchHf,
        pytorch_rows: &["bertbase_train_bf16_b32_autocast"],
    },
    RowSpec {
        key: "bertbase_train_bf16_b128",
        work: Work::BertBaseTrain {
            batch: 128,
            bf16: true,
        },
        devices: Devices::GpuOnly,
        reference: Reference::BenchHf,
        pytorch_rows: &["bertbase_train_bf16_b128_autocast"],
    },
    RowSpec {
        key: "roberta_train",
        work: Work::EncoderFamilyTrain,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["roberta_train_fp32"],
    },
    RowSpec {
        key: "distilbert_train",
        work: Work::EncoderFamilyTrain,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["distilbert_train_fp32"],
    },
    RowSpec {
        key: "modernbert_train",
        work: Work::EncoderFamilyTrain,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["modernbert_train_fp32"],
    },
    RowSpec {
        key: "mnist_train",
        work: Work::MnistTrain,
        devices: Devices::CpuAndGpu,
        reference: Reference::Extra,
        pytorch_rows: &["mnist_train_fp32"],
    },
    RowSpec {
        key: "tweets_train",
        work: Work::TweetsTrain,
        devices: Devices::CpuAndGpu,
        reference: Reference::Extra,
        // The target compares against PyTorch padding to 128 (what the tokenizer forces);
        // PyTorch with the same dynamic padding is shown as well.
        pytorch_rows: &["tweets_train_fixed128", "tweets_train_dynamic"],
    },
    RowSpec {
        // The Trainer's step with and without publishing live state for `kiln top` (goal: ≤ 1 %).
        key: "live_state",
        work: Work::LiveState,
        devices: Devices::Cpu,
        reference: Reference::KilnBaseline,
        pytorch_rows: &["live_state_off"],
    },
    RowSpec {
        key: "qwen2_train",
        work: Work::DecoderFamilyTrain,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["qwen2_train_fp32"],
    },
    RowSpec {
        key: "mistral_train",
        work: Work::DecoderFamilyTrain,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["mistral_train_fp32"],
    },
    RowSpec {
        key: "smollm2_train",
        work: Work::SmolLm2Train,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_train_fp32"],
    },
    RowSpec {
        key: "smollm2_train_bf16",
        work: Work::SmolLm2TrainBf16 { lora: false },
        devices: Devices::CpuAndGpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_train_bf16_autocast"],
    },
    RowSpec {
        key: "smollm2_lora_train_bf16",
        work: Work::SmolLm2TrainBf16 { lora: true },
        devices: Devices::GpuOnly,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_lora_train_bf16_autocast"],
    },
    RowSpec {
        key: "smollm2_lora_train",
        work: Work::LoraTrain { on_smollm2: true },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_lora_train_fp32"],
    },
    RowSpec {
        key: "qwen2_lora_train",
        work: Work::LoraTrain { on_smollm2: false },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["qwen2_lora_train_fp32"],
    },
    RowSpec {
        key: "deepseek1b3_lora_train",
        work: Work::LoraTrain { on_smollm2: false },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["deepseek1b3_lora_train_fp32"],
    },
    RowSpec {
        key: "smollm2_lora_bf16base_train",
        work: Work::LoraTrain { on_smollm2: true },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_lora_bf16base_train_fp32"],
    },
    RowSpec {
        key: "qwen2_lora_bf16base_train",
        work: Work::LoraTrain { on_smollm2: false },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["qwen2_lora_bf16base_train_fp32"],
    },
    RowSpec {
        key: "deepseek1b3_lora_bf16base_train",
        work: Work::LoraTrain { on_smollm2: false },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["deepseek1b3_lora_bf16base_train_fp32"],
    },
    RowSpec {
        key: "smollm2_prefill",
        work: Work::Prefill,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_prefill_fp32"],
    },
    RowSpec {
        key: "smollm2_generate",
        work: Work::Generate,
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["smollm2_generate_fp32"],
    },
    RowSpec {
        key: "dp_allreduce_mnist",
        work: Work::Collective {
            op: Op::AllReduce,
            engine: Engine::Burn,
            elements: Elements::MnistGradient,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_allreduce_mnist_gloo"],
    },
    RowSpec {
        key: "dp_allreduce_64mib",
        work: Work::Collective {
            op: Op::AllReduce,
            engine: Engine::Burn,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_allreduce_64mib_gloo"],
    },
    RowSpec {
        key: "dp_allreduce_64mib_mpi",
        work: Work::Collective {
            op: Op::AllReduce,
            engine: Engine::Mpi,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_allreduce_64mib_gloo"],
    },
    RowSpec {
        key: "dp_allgather_64mib",
        work: Work::Collective {
            op: Op::AllGather,
            engine: Engine::Burn,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_allgather_64mib_gloo"],
    },
    RowSpec {
        key: "dp_allgather_64mib_mpi",
        work: Work::Collective {
            op: Op::AllGather,
            engine: Engine::Mpi,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_allgather_64mib_gloo"],
    },
    RowSpec {
        key: "dp_reducescatter_64mib",
        work: Work::Collective {
            op: Op::ReduceScatter,
            engine: Engine::Burn,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_reducescatter_64mib_gloo"],
    },
    RowSpec {
        key: "dp_reducescatter_64mib_mpi",
        work: Work::Collective {
            op: Op::ReduceScatter,
            engine: Engine::Mpi,
            elements: Elements::Bucket,
        },
        devices: Devices::Cpu,
        reference: Reference::Extra,
        pytorch_rows: &["dp_reducescatter_64mib_gloo"],
    },
];

/// The row `key`, or an error listing the known ones.
pub fn row(key: &str) -> Result<&'static RowSpec> {
    ROWS.iter().find(|r| r.key == key).ok_or_else(|| {
        let known: Vec<_> = ROWS.iter().map(|r| r.key).collect();
        KilnError::Config(format!(
            "unknown benchmark {key:?} (known: {})",
            known.join(", ")
        ))
    })
}

/// The keys of the rows that run on a GPU.
pub fn gpu_rows() -> Vec<&'static str> {
    ROWS.iter()
        .filter(|r| r.devices != Devices::Cpu)
        .map(|r| r.key)
        .collect()
}
