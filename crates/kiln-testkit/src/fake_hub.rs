//! A stand-in for the Hugging Face Hub on 127.0.0.1, serving what kiln's Hub client asks of it:
//! `/{repo}/resolve/{revision}/{file}` (and `/datasets/…`) with the headers the real Hub sends
//! (`ETag`, `X-Repo-Commit`, `Content-Range` for ranged reads), `/api/{models,datasets}/{repo}/
//! revision/{revision}` file lists, and the real Hub's refusals: 401 `RepositoryNotFound` for an
//! unknown repo, 401 `GatedRepo` without the right token, 404 `EntryNotFound` for a missing file.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One repository: its files, the commit they are at, and the token a gated repo wants.
#[derive(Clone, Default)]
pub struct FakeRepo {
    pub files: BTreeMap<String, Vec<u8>>,
    pub commit: String,
    pub gated_token: Option<String>,
    /// Revisions besides `main` and the commit itself (tags, `refs/convert/parquet`).
    pub revisions: Vec<String>,
}

impl FakeRepo {
    /// Every file of a local folder (recursively), at a commit named after `seed`.
    pub fn from_dir(dir: &std::path::Path, seed: &str) -> Self {
        fn walk(
            base: &std::path::Path,
            dir: &std::path::Path,
            out: &mut BTreeMap<String, Vec<u8>>,
        ) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(base, &p, out);
                } else {
                    let name = p
                        .strip_prefix(base)
                        .unwrap()
                        .to_string_lossy()
                        .replace('\\', "/");
                    out.insert(name, std::fs::read(&p).unwrap());
                }
            }
        }
        let mut files = BTreeMap::new();
        walk(dir, dir, &mut files);
        Self {
            files,
            commit: format!(
                "{:0>40}",
                seed.bytes().map(|b| format!("{b:x}")).collect::<String>()
            )[..40]
                .to_string(),
            ..Default::default()
        }
    }
}

pub struct FakeHub {
    pub url: String,
    /// Paths of the file downloads served (GETs of content, not the HEAD metadata probes).
    pub downloads: Arc<Mutex<Vec<String>>>,
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).unwrap()
}

fn refuse(status: u16, code: &str) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    tiny_http::Response::from_data(code.as_bytes().to_vec())
        .with_status_code(status)
        .with_header(header("X-Error-Code", code))
}

impl FakeHub {
    /// Serves `models` and `datasets` (keyed by repo id) until dropped.
    pub fn start(models: BTreeMap<String, FakeRepo>, datasets: BTreeMap<String, FakeRepo>) -> Self {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let url = format!("http://{}", server.server_addr().to_ip().unwrap());
        let downloads = Arc::new(Mutex::new(Vec::new()));
        let (srv, log) = (server.clone(), downloads.clone());
        let thread = std::thread::spawn(move || {
            for req in srv.incoming_requests() {
                let resp = Self::answer(&req, &models, &datasets, &log);
                let _ = req.respond(resp);
            }
        });
        Self {
            url,
            downloads,
            server,
            thread: Some(thread),
        }
    }

    fn answer(
        req: &tiny_http::Request,
        models: &BTreeMap<String, FakeRepo>,
        datasets: &BTreeMap<String, FakeRepo>,
        log: &Mutex<Vec<String>>,
    ) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
        let path = req.url().split('?').next().unwrap().to_string();
        let auth = req
            .headers()
            .iter()
            .find(|h| h.field.equiv("Authorization"))
            .map(|h| h.value.as_str().to_string());
        let range = req
            .headers()
            .iter()
            .find(|h| h.field.equiv("Range"))
            .map(|h| h.value.as_str().to_string());
        // File lists: /api/{models|datasets}/{repo}/revision/{rev}
        if let Some(rest) = path.strip_prefix("/api/") {
            let (kind, rest) = rest.split_once('/').unwrap_or(("", ""));
            let repos = if kind == "datasets" { datasets } else { models };
            let Some((repo_id, rev)) = rest.rsplit_once("/revision/") else {
                return refuse(404, "EntryNotFound");
            };
            let Some(repo) = repos.get(repo_id) else {
                return refuse(401, "RepositoryNotFound");
            };
            let rev = decode(rev);
            if rev != "main" && rev != repo.commit && !repo.revisions.contains(&rev) {
                return refuse(404, "RevisionNotFound");
            }
            let siblings: Vec<_> = repo
                .files
                .keys()
                .map(|f| serde_json::json!({ "rfilename": f }))
                .collect();
            let body = serde_json::json!({"sha": repo.commit, "siblings": siblings});
            return tiny_http::Response::from_data(body.to_string().into_bytes())
                .with_header(header("Content-Type", "application/json"));
        }
        // Files: [/datasets]/{repo}/resolve/{rev}/{file}
        let (repos, rest) = match path.strip_prefix("/datasets/") {
            Some(r) => (datasets, r.to_string()),
            None => (models, path[1..].to_string()),
        };
        let Some((repo_id, rest)) = rest.split_once("/resolve/") else {
            return refuse(404, "EntryNotFound");
        };
        let Some(repo) = repos.get(repo_id) else {
            return refuse(401, "RepositoryNotFound");
        };
        if let Some(t) = &repo.gated_token {
            if auth.as_deref() != Some(&format!("Bearer {t}")) {
                return refuse(401, "GatedRepo");
            }
        }
        let (rev, file) = rest.split_once('/').unwrap_or((rest, ""));
        let rev = decode(rev);
        if rev != "main" && rev != repo.commit && !repo.revisions.contains(&rev) {
            return refuse(404, "RevisionNotFound");
        }
        let file = decode(file);
        let Some(data) = repo.files.get(&file) else {
            return refuse(404, "EntryNotFound");
        };
        let total = data.len();
        let (start, end) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
            Some(r) => {
                let (a, b) = r.split_once('-').unwrap();
                let a: usize = a.parse().unwrap();
                let b: usize = if b.is_empty() {
                    total.saturating_sub(1)
                } else {
                    b.parse().unwrap()
                };
                (a.min(total), (b + 1).min(total))
            }
            None => (0, total),
        };
        let head = *req.method() == tiny_http::Method::Head;
        if !head {
            log.lock().unwrap().push(format!("{repo_id}/{file}"));
        }
        let etag = format!("\"{:016x}{:08x}\"", fxhash(data), total);
        // The size as the Hub announces it: tiny_http sends large bodies chunked, without a
        // Content-Length, so the header the Hub sets for LFS files carries it.
        let mut resp = tiny_http::Response::from_data(data[start..end].to_vec())
            .with_header(header("ETag", &etag))
            .with_header(header("X-Linked-Size", &total.to_string()))
            .with_header(header("X-Repo-Commit", &repo.commit));
        if range.is_some() {
            resp = resp.with_status_code(206).with_header(header(
                "Content-Range",
                &format!("bytes {start}-{}/{total}", end.saturating_sub(1)),
            ));
        }
        resp
    }
}

/// A content hash for ETags (FNV-1a: stable and dependency-free).
fn fxhash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}
