//! The Hub client against a hostile or broken server on 127.0.0.1: every answer that would write
//! outside the cache, leak the token or a password, hang, loop, panic or cache a wrong file is one
//! sentence, and nothing lands in the cache or outside it.

mod kiln_bin;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_bin::kiln;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_hostileTESTtoken0123456789";
const CONFIG: &str = r#"{"model_type": "bert"}"#;

type Handler =
    dyn Fn(&tiny_http::Request) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> + Send + Sync;

/// One request as the server saw it: method, path and `Authorization` header.
type Seen = (String, String, Option<String>);

/// A server answering every request with `handler`; every request's method, path and
/// `Authorization` header are logged.
struct Server {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(handler: Box<Handler>) -> Self {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let url = format!("http://{}", server.server_addr().to_ip().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (srv, log) = (server.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            for req in srv.incoming_requests() {
                let auth = req
                    .headers()
                    .iter()
                    .find(|h| h.field.equiv("Authorization"))
                    .map(|h| h.value.to_string());
                log.lock()
                    .unwrap()
                    .push((req.method().to_string(), req.url().to_string(), auth));
                let resp = handler(&req);
                let _ = req.respond(resp);
            }
        });
        Self {
            url,
            seen,
            server,
            thread: Some(thread),
        }
    }

    fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).unwrap()
}

fn ok(body: &[u8]) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    tiny_http::Response::from_data(body.to_vec())
}

/// The headers the Hub sends with a file: its commit, ETag and size.
fn file_headers(
    r: tiny_http::Response<std::io::Cursor<Vec<u8>>>,
    etag: &str,
    size: usize,
) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    r.with_header(header("X-Repo-Commit", COMMIT))
        .with_header(header("ETag", etag))
        .with_header(header("X-Linked-Size", &size.to_string()))
}

/// `kiln train --from-config MODEL` (it needs config.json alone) against `endpoint`, with the
/// cache in `tmp/cache` and the other inputs in `tmp/keep`; the process is killed after 60 s.
fn train_from_config(
    tmp: &Path,
    endpoint: &str,
    model: &str,
    env: &[(&str, &str)],
) -> (Output, Duration) {
    let started = Instant::now();
    // Local stand-ins for the other inputs (the run stops at them once the config is had).
    let keep = tmp.join("keep");
    std::fs::create_dir_all(&keep).unwrap();
    std::fs::write(keep.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(keep.join("train.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    let mut c = kiln();
    c.args(["train", "--task", "causal-lm", "--from-config", model])
        .arg("--tokenizer")
        .arg(keep.join("tokenizer.json"))
        .arg("--train-file")
        .arg(keep.join("train.jsonl"))
        .arg("--output-dir")
        .arg(tmp.join("run"))
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HUB_CACHE", tmp.join("cache"))
        .env("HF_TOKEN", TOKEN)
        .env_remove("HF_HUB_OFFLINE")
        .envs(env.iter().copied());
    let child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let id = child.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        unsafe { libc::kill(id as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().unwrap();
    drop(watchdog);
    (out, started.elapsed())
}

/// Every file under `dir` (symbolic links included, not followed).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd {
        let p = e.unwrap().path();
        if p.is_dir() && !p.is_symlink() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The run failed with one `error:` sentence holding `expect`, without a panic, a secret or a
/// byte outside the cache, and with no blob or snapshot file in the cache.
fn refused(tmp: &Path, (out, _): &(Output, Duration), expect: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(expect), "expected {expect:?} in: {err}");
    assert!(!err.contains(TOKEN), "the token was printed: {err}");
    let outside: Vec<_> = files(tmp)
        .into_iter()
        .filter(|p| !p.starts_with(tmp.join("cache")) && !p.starts_with(tmp.join("keep")))
        .collect();
    assert!(outside.is_empty(), "written outside the cache: {outside:?}");
    let cached: Vec<_> = files(&tmp.join("cache"))
        .into_iter()
        .filter(|p| {
            let s = p.to_string_lossy();
            s.contains("/blobs/") || s.contains("/snapshots/")
        })
        .collect();
    assert!(cached.is_empty(), "cached: {cached:?}");
}

fn is_head(r: &tiny_http::Request) -> bool {
    *r.method() == tiny_http::Method::Head
}

#[test]
fn paths_from_the_server_never_leave_the_cache() {
    for (what, etag, commit, expect) in [
        (
            "relative ETag",
            "\"../../../../escape\"",
            COMMIT,
            "ETag \"\\\"../../../../escape\\\"\" is not a plain name",
        ),
        (
            "absolute ETag",
            "\"/tmp/kiln-hostile-escape\"",
            COMMIT,
            "is not a plain name",
        ),
        (
            "relative commit",
            "\"abc\"",
            "../..",
            "X-Repo-Commit \"../..\" is not a commit hash",
        ),
        (
            "absolute commit",
            "\"abc\"",
            "/tmp/x",
            "is not a commit hash",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (etag, commit) = (etag.to_string(), commit.to_string());
        let hub = Server::start(Box::new(move |_| {
            ok(CONFIG.as_bytes())
                .with_header(header("X-Repo-Commit", &commit))
                .with_header(header("ETag", &etag))
                .with_header(header("X-Linked-Size", &CONFIG.len().to_string()))
        }));
        let run = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
        refused(tmp.path(), &run, expect);
        assert!(!Path::new("/tmp/kiln-hostile-escape").exists(), "{what}");
    }
}

#[test]
fn a_revision_is_a_ref_name_not_a_path() {
    let tmp = tempfile::tempdir().unwrap();
    let keep = tmp.path().join("keep/file");
    std::fs::create_dir_all(keep.parent().unwrap()).unwrap();
    std::fs::write(&keep, "mine").unwrap();
    let hub = Server::start(Box::new(|_| {
        file_headers(ok(CONFIG.as_bytes()), "\"abc\"", CONFIG.len())
    }));
    for model in [
        format!("org/x@{}", keep.display()),
        "org/x@../../keep".to_string(),
    ] {
        let (out, _) = train_from_config(tmp.path(), &hub.url, &model, &[]);
        assert!(!out.status.success());
        assert_eq!(std::fs::read_to_string(&keep).unwrap(), "mine", "{model}");
    }
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
}

#[test]
fn the_token_stays_with_the_endpoints_host() {
    let tmp = tempfile::tempdir().unwrap();
    let cdn = Server::start(Box::new(|_| ok(CONFIG.as_bytes())));
    let cdn_url = format!("{}/blob/config.json", cdn.url);
    // The Hub's LFS answer: a redirect to the CDN carrying the file's metadata.
    let hub = Server::start(Box::new(move |r| {
        if r.url().contains("/relative/") {
            return file_headers(tiny_http::Response::from_data(vec![]), "\"e1\"", 0)
                .with_status_code(302)
                .with_header(header("Location", "/org/x/resolve/main/config.json"));
        }
        file_headers(
            tiny_http::Response::from_data(vec![]).with_status_code(302),
            "\"e1\"",
            CONFIG.len(),
        )
        .with_header(header("Location", &cdn_url))
    }));
    let (out, _) = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    // The file arrived (the run then stops for want of a tokenizer), and the CDN never saw the token.
    let config = tmp.path().join(format!(
        "cache/models--org--x/snapshots/{COMMIT}/config.json"
    ));
    assert_eq!(std::fs::read_to_string(&config).unwrap(), CONFIG, "{err}");
    assert!(hub
        .requests()
        .iter()
        .all(|r| r.2.as_deref() == Some(&format!("Bearer {TOKEN}"))));
    let at_cdn = cdn.requests();
    assert!(
        !at_cdn.is_empty() && at_cdn.iter().all(|r| r.2.is_none()),
        "{at_cdn:?}"
    );
}

#[test]
fn a_password_in_hf_endpoint_is_never_printed() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Server::start(Box::new(|_| ok(b"").with_status_code(500)));
    let with_password = hub.url.replace("http://", "http://user:pw-s3cret@");
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://user:pw-s3cret@{}", closed.local_addr().unwrap());
    drop(closed);
    for (endpoint, expect) in [(with_password, "HTTP 500"), (dead, "cannot reach")] {
        let (out, _) = train_from_config(tmp.path(), &endpoint, "org/x", &[]);
        let all = [out.stdout, out.stderr].concat();
        let all = String::from_utf8_lossy(&all);
        assert!(all.contains(expect), "{all}");
        assert!(!all.contains("pw-s3cret"), "{all}");
    }
}

#[test]
fn a_silent_server_times_out() {
    let tmp = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // Accepts and never answers.
    let held = std::thread::spawn(move || {
        let mut conns = vec![];
        for c in listener.incoming().take(4) {
            conns.push(c);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let run = train_from_config(tmp.path(), &url, "org/x", &[("HF_HUB_ETAG_TIMEOUT", "1")]);
    refused(tmp.path(), &run, "cannot reach the Hugging Face Hub");
    assert!(run.1 < Duration::from_secs(20), "took {:?}", run.1);
    drop(held);
}

#[test]
fn redirects_are_bounded_and_need_a_location() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Server::start(Box::new(|r| {
        if r.url().contains("config.json") {
            tiny_http::Response::from_data(vec![])
                .with_status_code(302)
                .with_header(header("Location", "/loop"))
        } else {
            tiny_http::Response::from_data(vec![])
                .with_status_code(307)
                .with_header(header("Location", "loop"))
        }
    }));
    let run = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
    refused(tmp.path(), &run, "more than 10 redirects");
    assert!(
        hub.requests().len() <= 11,
        "{} requests",
        hub.requests().len()
    );

    let tmp = tempfile::tempdir().unwrap();
    let hub = Server::start(Box::new(|_| {
        tiny_http::Response::from_data(vec![]).with_status_code(302)
    }));
    let run = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
    refused(tmp.path(), &run, "HTTP 302 without a Location");
}

#[test]
fn a_body_that_is_not_the_announced_file_is_not_cached() {
    let sha_of_other = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let junk: Vec<u8> = CONFIG
        .bytes()
        .chain(std::iter::repeat_n(b'x', 300_000))
        .collect();
    let html = b"<html><body>Sign in</body></html>".to_vec();
    for (what, etag, announced, body, expect) in [
        (
            "short",
            "\"e1\"",
            1000,
            CONFIG.as_bytes().to_vec(),
            "where 1000 were announced",
        ),
        (
            "junk after the file",
            "\"e1\"",
            CONFIG.len(),
            junk,
            "more than",
        ),
        ("an HTML page", "\"e1\"", CONFIG.len(), html, "bytes where"),
        (
            "another file's hash",
            sha_of_other,
            CONFIG.len(),
            CONFIG.as_bytes().to_vec(),
            "SHA-256",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let hub = Server::start(Box::new(move |r| {
            let r0 = if is_head(r) { ok(b"") } else { ok(&body) };
            file_headers(r0, etag, announced)
        }));
        let run = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
        refused(tmp.path(), &run, expect);
        let _ = what;
    }
}

#[test]
fn an_lfs_file_whose_hash_is_right_is_cached() {
    let tmp = tempfile::tempdir().unwrap();
    use std::fmt::Write;
    let sha: String = {
        // SHA-256 of CONFIG, by the system's sha256sum (an independent implementation).
        let mut child = Command::new("sha256sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(CONFIG.as_bytes())
            .unwrap();
        let mut s = String::new();
        child.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        child.wait().unwrap();
        let mut out = String::new();
        write!(out, "{}", s.split_whitespace().next().unwrap()).unwrap();
        out
    };
    let etag = format!("\"{sha}\"");
    let hub = Server::start(Box::new(move |r| {
        let r0 = if is_head(r) {
            ok(b"")
        } else {
            ok(CONFIG.as_bytes())
        };
        file_headers(r0, &etag, CONFIG.len())
    }));
    let _ = train_from_config(tmp.path(), &hub.url, "org/x", &[]);
    let blob = tmp.path().join(format!("cache/models--org--x/blobs/{sha}"));
    assert_eq!(std::fs::read_to_string(blob).unwrap(), CONFIG);
}
