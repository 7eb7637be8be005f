//! Hugging Face Hub ids (`bert-base-uncased`, `org/name`, `org/name@revision`) wherever a model
//! folder, a tokenizer or a config is asked for, through kiln's client ([`super::client`]): files
//! land in the cache layout Python's `huggingface_hub` uses (`models--org--name/snapshots/<commit>/…`),
//! so a model either side downloaded is not fetched again. The environment is read as Python reads
//! it: `HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN` (else the token file `huggingface-cli
//! login` writes), `HF_HUB_OFFLINE`, `HF_HUB_ETAG_TIMEOUT`, `HF_HUB_DOWNLOAD_TIMEOUT`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::client::{Client, ClientConfig, Endpoint, Failure, RepoKind};
use crate::error::{KilnError, Result};

/// A repository on the Hub and the revision (branch, tag or commit) asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// `name`, `org/name`, with `@revision` optionally: the characters the Hub allows in ids
    /// (letters, digits, `-`, `_`, `.`), no `..` or `--`, at most 96 characters.
    pub fn parse(s: &str) -> Option<Self> {
        let (repo, revision) = match s.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return None,
            None => (s, "main"),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let valid_part = |p: &&str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && !p.ends_with(['.', '-'])
                && !p.contains("..")
                && !p.contains("--")
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if parts.len() > 2 || repo.len() > 96 || !parts.iter().all(valid_part) {
            return None;
        }
        // The revision becomes part of a URL and of a `refs/` path in the cache.
        if !super::client::valid_revision(revision) {
            return None;
        }
        Some(Self {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" {
            write!(f, "{}", self.repo)
        } else {
            write!(f, "{}@{}", self.repo, self.revision)
        }
    }
}

/// What a command needs of a model argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A whole model folder: config, weights (one file or shards), tokenizer files.
    Model,
    /// `config.json` alone (`--from-config`).
    Config,
    /// `tokenizer.json` alone (`--tokenizer`).
    Tokenizer,
}

/// Files a model folder may have beside its config and weights; fetched when the repo has them.
const MODEL_EXTRAS: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// A local path as given, or the cached copy of a Hub repo's files for `need`: the snapshot
/// folder for [`Need::Model`], the file itself for the others. An argument that is neither an
/// existing path nor a valid Hub id is returned as it is, for the caller's "not found".
pub fn resolve(arg: &Path, need: Need) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let Some(id) = arg.to_str().and_then(HubId::parse) else {
        return Ok(arg.to_path_buf());
    };
    Hub::from_env()?.model_files(&id, need)
}

/// The Hub as the environment configures it.
pub struct Hub {
    client: Client,
    offline: bool,
}

/// Why a file could not be had.
enum Missing {
    /// The repo exists but has no such file.
    File,
    /// Offline, and the cache does not hold it.
    NotCached,
    Fatal(KilnError),
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A timeout in seconds from `name` (huggingface_hub's default: 10 s).
fn timeout(name: &str) -> Result<Duration> {
    match env(name) {
        None => Ok(Duration::from_secs(10)),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                KilnError::Config(format!(
                    "{name}={v:?} is not a number of seconds between 0 and 86400"
                ))
            }),
    }
}

impl Hub {
    pub fn from_env() -> Result<Self> {
        let home = env("HF_HOME")
            .map(PathBuf::from)
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache").join("huggingface")));
        let cache = match (env("HF_HUB_CACHE"), &home) {
            (Some(c), _) => PathBuf::from(c),
            (None, Some(h)) => h.join("hub"),
            (None, None) => {
                return Err(KilnError::Config(
                    "no Hugging Face cache folder: set HF_HUB_CACHE, HF_HOME or HOME".into(),
                ))
            }
        };
        let token = env("HF_TOKEN").or_else(|| {
            let file = home.as_ref()?.join("token");
            let t = std::fs::read_to_string(file).ok()?;
            Some(t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let endpoint =
            Endpoint::parse(&env("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()))
                .map_err(KilnError::Config)?;
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| ["1", "ON", "YES", "TRUE"].contains(&v.to_uppercase().as_str()));
        let client = Client::new(ClientConfig {
            endpoint,
            token,
            cache,
            etag_timeout: timeout("HF_HUB_ETAG_TIMEOUT")?,
            download_timeout: timeout("HF_HUB_DOWNLOAD_TIMEOUT")?,
            progress: std::io::stderr().is_terminal(),
        });
        Ok(Self { client, offline })
    }

    /// The cached files of model repo `id` that `need` asks for (downloaded unless cached).
    pub fn model_files(&self, id: &HubId, need: Need) -> Result<PathBuf> {
        let kind = RepoKind::Model;
        match need {
            Need::Config => self.required(id, kind, "config.json"),
            Need::Tokenizer => self.required(id, kind, "tokenizer.json"),
            Need::Model => {
                let config = self.required(id, kind, "config.json")?;
                self.weights(id)?;
                for f in MODEL_EXTRAS {
                    self.optional(id, kind, f)?;
                }
                Ok(config
                    .parent()
                    .expect("a cached file is in a snapshot folder")
                    .to_path_buf())
            }
        }
    }

    /// `model.safetensors`, else the shards `model.safetensors.index.json` lists.
    fn weights(&self, id: &HubId) -> Result<()> {
        let kind = RepoKind::Model;
        if self.optional(id, kind, "model.safetensors")?.is_some() {
            return Ok(());
        }
        let Some(index) = self.optional(id, kind, "model.safetensors.index.json")? else {
            if self.offline {
                return Err(self.not_cached(id, "model.safetensors"));
            }
            let pickle = if self.exists(id, "pytorch_model.bin") {
                " (it has only pytorch_model.bin, a pickle kiln does not read: convert it with \
                 transformers' save_pretrained(..., safe_serialization=True))"
            } else {
                ""
            };
            return Err(KilnError::Config(format!(
                "Hub model {id} has no model.safetensors or model.safetensors.index.json{pickle}"
            )));
        };
        let json: serde_json::Value = crate::io::read_json(&index)?;
        let mut shards: Vec<&str> = json["weight_map"]
            .as_object()
            .ok_or_else(|| {
                KilnError::Config(format!(
                    "{} (Hub model {id}): no \"weight_map\" object",
                    index.display()
                ))
            })?
            .values()
            .filter_map(|v| v.as_str())
            .collect();
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            // Shard names come from the repo: only plain file names are fetched.
            if shard.contains('/') || !super::client::valid_file_name(shard) {
                return Err(KilnError::Config(format!(
                    "{} (Hub model {id}): shard {:?} is not a file name",
                    index.display(),
                    crate::error::escape_for_terminal(shard)
                )));
            }
            self.required(id, kind, shard)?;
        }
        Ok(())
    }

    fn required(&self, id: &HubId, kind: RepoKind, file: &str) -> Result<PathBuf> {
        match self.fetch(id, kind, file) {
            Ok(p) => Ok(p),
            Err(Missing::File) => Err(KilnError::Config(format!("Hub repo {id} has no {file}"))),
            Err(Missing::NotCached) => Err(self.not_cached(id, file)),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }

    /// A file the repo may lack: `None` when it does (or, offline, when the cache lacks it).
    fn optional(&self, id: &HubId, kind: RepoKind, file: &str) -> Result<Option<PathBuf>> {
        match self.fetch(id, kind, file) {
            Ok(p) => Ok(Some(p)),
            Err(Missing::File | Missing::NotCached) => Ok(None),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }

    fn not_cached(&self, id: &HubId, file: &str) -> KilnError {
        KilnError::Config(format!(
            "{file} of Hub repo {id} is not in the cache ({}) and HF_HUB_OFFLINE is set",
            self.client.cache().display()
        ))
    }

    /// Whether the repo lists `file` (asked without downloading it).
    fn exists(&self, id: &HubId, file: &str) -> bool {
        self.client
            .list_files(RepoKind::Model, &id.repo, &id.revision)
            .is_ok_and(|files| files.iter().any(|f| f == file))
    }

    /// One file from the cache, else from the Hub (unless offline).
    fn fetch(
        &self,
        id: &HubId,
        kind: RepoKind,
        file: &str,
    ) -> std::result::Result<PathBuf, Missing> {
        self.client
            .file(kind, &id.repo, &id.revision, file, self.offline)
            .map_err(|e| self.explain(id, file, e))
    }

    /// One sentence for a failed request: a missing repo, a gated one, a network failure, an
    /// answer kiln refuses.
    fn explain(&self, id: &HubId, file: &str, e: Failure) -> Missing {
        let fatal = |m: String| Missing::Fatal(KilnError::Config(m));
        let endpoint = self.client.endpoint().shown();
        match e {
            Failure::NotCached => Missing::NotCached,
            Failure::Status { code, error_code } => match (code, error_code.as_str()) {
                (_, "GatedRepo") => fatal(format!(
                    "Hub repo {id} is gated: accept its conditions on {endpoint}/{} and set \
                     HF_TOKEN to a token of that account",
                    id.repo
                )),
                (_, "RepositoryNotFound") | (401, "") => fatal(format!(
                    "Hub repo {id} does not exist (or it is private: set HF_TOKEN), and no \
                     local folder has that name"
                )),
                (_, "RevisionNotFound") => fatal(format!(
                    "Hub repo {} has no revision {:?}",
                    id.repo, id.revision
                )),
                (404, _) => Missing::File,
                (403, _) => fatal(format!(
                    "Hub repo {id}: access refused (HTTP 403) — the token set in HF_TOKEN has \
                     no access to it"
                )),
                (c, _) => fatal(format!("Hub repo {id}, {file}: HTTP {c} from {endpoint}")),
            },
            Failure::Transport(t) => fatal(format!(
                "cannot reach the Hugging Face Hub at {endpoint} for {id} ({t}); files \
                 downloaded before are used with HF_HUB_OFFLINE=1"
            )),
            Failure::Refused(why) => fatal(format!(
                "Hub repo {id}, {file}: the answer from {endpoint} was refused: {}; nothing was \
                 cached",
                crate::error::escape_for_terminal(&why)
            )),
            Failure::Io(why) => fatal(format!(
                "Hub repo {id}, {file}: cannot write the cache: {why}"
            )),
        }
    }

    /// A dataset repo's files under a revision (for its Parquet conversion), as listed by the Hub.
    pub fn dataset_files(&self, id: &HubId) -> Result<Vec<String>> {
        if self.offline {
            return Err(KilnError::Config(format!(
                "Hub dataset {id}: listing its files needs the network, and HF_HUB_OFFLINE is set"
            )));
        }
        match self
            .client
            .list_files(RepoKind::Dataset, &id.repo, &id.revision)
        {
            Ok(files) => Ok(files),
            Err(e) => Err(match self.explain(id, "the file list", e) {
                Missing::File | Missing::NotCached => KilnError::Config(format!(
                    "Hub dataset {} does not exist (or it is private: set HF_TOKEN)",
                    id.repo
                )),
                Missing::Fatal(e) => e,
            }),
        }
    }

    /// One file of a dataset repo, from the cache or downloaded.
    pub fn dataset_file(&self, id: &HubId, file: &str) -> Result<PathBuf> {
        match self.fetch(id, RepoKind::Dataset, file) {
            Ok(p) => Ok(p),
            Err(Missing::File) => Err(KilnError::Config(format!("Hub dataset {id} has no {file}"))),
            Err(Missing::NotCached) => Err(self.not_cached(id, file)),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }
}

/// The revision under which the Hub serves every public dataset converted to Parquet.
pub const PARQUET_REVISION: &str = "refs/convert/parquet";

/// Local folders of a Hub dataset's splits, from its Parquet conversion (`CONFIG/SPLIT/*.parquet`
/// under [`PARQUET_REVISION`]): `train_split` (default `train`) when `want_train`, and
/// `eval_split`, else `validation`, else `test` (none if neither exists). Each folder holds the
/// split's Parquet files, downloaded into the cache.
pub fn dataset_splits(
    name: &str,
    config: Option<&str>,
    train_split: Option<&str>,
    eval_split: Option<&str>,
    want_train: bool,
) -> Result<(Option<PathBuf>, Option<PathBuf>)> {
    let repo = HubId::parse(name)
        .filter(|id| id.revision == "main")
        .ok_or_else(|| {
            KilnError::Config(format!(
                "--dataset-name {name:?} is not a Hub dataset id (`name` or `org/name`; its \
                 Parquet conversion is always read)"
            ))
        })?
        .repo;
    let id = HubId {
        repo,
        revision: PARQUET_REVISION.into(),
    };
    let hub = Hub::from_env()?;
    let files: Vec<String> = hub
        .dataset_files(&id)?
        .into_iter()
        // CONFIG/SPLIT/FILE.parquet; names come from the server and become cache paths: no
        // empty, `.` or `..` parts.
        .filter(|f| {
            let parts: Vec<&str> = f.split('/').collect();
            f.ends_with(".parquet")
                && parts.len() == 3
                && parts
                    .iter()
                    .all(|p| !p.is_empty() && *p != "." && *p != "..")
        })
        .collect();
    let mut configs: Vec<&str> = files.iter().filter_map(|f| f.split('/').next()).collect();
    configs.sort_unstable();
    configs.dedup();
    let config = match (config, configs.as_slice()) {
        (Some(c), _) if configs.contains(&c) => c,
        (Some(c), _) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {}: no config {c:?} (configs: {})",
                id.repo,
                configs.join(", ")
            )))
        }
        (None, [only]) => only,
        (None, []) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {} has no Parquet conversion (no CONFIG/SPLIT/*.parquet files at \
                 {PARQUET_REVISION})",
                id.repo
            )))
        }
        (None, many) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {} has several configs ({}): pick one with --dataset-config",
                id.repo,
                many.join(", ")
            )))
        }
    };
    let split_files = |split: &str| -> Vec<&String> {
        let prefix = format!("{config}/{split}/");
        files.iter().filter(|f| f.starts_with(&prefix)).collect()
    };
    let mut splits: Vec<&str> = files
        .iter()
        .filter(|f| f.starts_with(&format!("{config}/")))
        .filter_map(|f| f.split('/').nth(1))
        .collect();
    splits.sort_unstable();
    splits.dedup();
    let fetch = |split: &str| -> Result<PathBuf> {
        let wanted = split_files(split);
        if wanted.is_empty() {
            return Err(KilnError::Config(format!(
                "Hub dataset {} ({config}): no split {split:?} (splits: {})",
                id.repo,
                splits.join(", ")
            )));
        }
        let mut dir = None;
        for f in wanted {
            let local = hub.dataset_file(&id, f)?;
            dir = local.parent().map(Path::to_path_buf);
        }
        Ok(dir.expect("at least one file"))
    };
    let train = if want_train {
        Some(fetch(train_split.unwrap_or("train"))?)
    } else {
        None
    };
    let eval = match eval_split {
        Some(s) => Some(fetch(s)?),
        None => match ["validation", "test"]
            .into_iter()
            .find(|s| splits.contains(s))
        {
            Some(s) => Some(fetch(s)?),
            None => None,
        },
    };
    Ok((train, eval))
}

/// The Hub id of a path inside the Hugging Face cache, as [`resolve`] leaves it
/// (`…/models--org--name/snapshots/<commit>/…` → `org/name`; datasets likewise), for the model
/// card to name where a run started from.
pub fn cached_repo_id(path: &Path) -> Option<String> {
    path.components().find_map(|c| {
        let name = c.as_os_str().to_str()?;
        let rest = name
            .strip_prefix("models--")
            .or_else(|| name.strip_prefix("datasets--"))?;
        Some(rest.replace("--", "/"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_parse_as_the_hub_allows_them() {
        let id = HubId::parse("org/name@v1.0").unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("org/name", "v1.0")
        );
        assert_eq!(HubId::parse("bert-base-uncased").unwrap().revision, "main");
        for bad in [
            "./model",
            "/abs/path",
            "a/b/c",
            "a..b",
            "x@",
            "org/-name",
            "a b",
            "",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cache_paths_name_their_repo() {
        let p = Path::new("/h/hub/models--org--tiny-bert/snapshots/abc/config.json");
        assert_eq!(cached_repo_id(p).as_deref(), Some("org/tiny-bert"));
        let d = Path::new("/h/hub/datasets--tweets/snapshots/1/default/train/0000.parquet");
        assert_eq!(cached_repo_id(d).as_deref(), Some("tweets"));
        assert_eq!(cached_repo_id(Path::new("assets/minilm")), None);
    }
}
