//! Indexes and `.npy` files: exactness, recall, persistence, and every error path.

use rak_retrieval::index::{self, Bm25Index, Bm25Params, FlatBackend, FlatIndex, HnswBuilder, HnswIndex, HnswParams, Index};
use rak_retrieval::npy::{self, NpyF32, NpyWriter};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

fn tmpdir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!("rak-index-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// splitmix64 → standard normals (Box-Muller); deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn u(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (a, b) = (self.u().max(1e-12), self.u());
        ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
    }
}

/// `n` vectors of width `d` whose norms vary from 0.3x to 3x: MIPS differs from cosine.
fn vectors(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed);
    let mut v = Vec::with_capacity(n * d);
    for _ in 0..n {
        let scale = (0.3 + 2.7 * r.u()) as f32;
        for _ in 0..d {
            v.push(r.normal() * scale);
        }
    }
    v
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("doc{i}")).collect()
}

fn brute_force(base: &[f32], q: &[f32], d: usize, k: usize) -> Vec<(usize, f64)> {
    let mut s: Vec<(usize, f64)> = base.chunks(d).enumerate().map(|(i, x)| (i, x.iter().zip(q).map(|(a, b)| *a as f64 * *b as f64).sum())).collect();
    s.sort_by(|a, b| b.1.total_cmp(&a.1));
    s.truncate(k);
    s
}

fn err<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn flat_search_over_several_score_blocks() {
    // 4,500 queries are searched as batches of 4,096 and 404; the first batch makes score
    // blocks of 1,024 rows, so 3,000 rows take three blocks and the running top-k carries over
    // from one to the next. Scores must match the f64 brute force rank by rank (rows too,
    // except where two scores are closer than f32 rounding).
    let (n, d, nq, k) = (3000, 16, 4500, 10);
    let base = vectors(n, d, 21);
    let queries = vectors(nq, d, 22);
    let hits = FlatIndex::new(base.clone(), d, ids(n)).unwrap().search(&queries, d, k).unwrap();
    for (qi, q) in queries.chunks(d).enumerate() {
        let want = brute_force(&base, q, d, k + 1);
        assert_eq!(hits[qi].len(), k);
        for (i, h) in hits[qi].iter().enumerate() {
            let tol = 1e-4 * want[i].1.abs().max(1.0);
            assert!((h.score as f64 - want[i].1).abs() < tol, "query {qi} rank {i}: {} vs {}", h.score, want[i].1);
            let close = |j: usize| (want[j].1 - want[i].1).abs() < tol;
            assert!(h.row == want[i].0 || (i > 0 && close(i - 1)) || close(i + 1), "query {qi} rank {i}: row {} vs {}", h.row, want[i].0);
        }
    }
}

#[test]
fn flat_equals_brute_force_on_both_backends() {
    let (n, d, nq, k) = (3000, 48, 25, 10);
    let base = vectors(n, d, 1);
    let queries = vectors(nq, d, 2);
    let flat = FlatIndex::new(base.clone(), d, ids(n)).unwrap();
    for backend in [FlatBackend::Torch, FlatBackend::Rust] {
        let hits = flat.search_with(backend, &queries, d, k).unwrap();
        assert_eq!(hits.len(), nq);
        for (qi, q) in queries.chunks(d).enumerate() {
            let want = brute_force(&base, q, d, k);
            let got: Vec<usize> = hits[qi].iter().map(|h| h.row).collect();
            assert_eq!(got, want.iter().map(|w| w.0).collect::<Vec<_>>(), "{backend:?} query {qi}");
            for (h, w) in hits[qi].iter().zip(&want) {
                assert!((h.score as f64 - w.1).abs() < 1e-3 * w.1.abs().max(1.0), "{backend:?}: {} vs {}", h.score, w.1);
            }
        }
    }
    // k larger than the index returns every row.
    let small = FlatIndex::new(base[..5 * d].to_vec(), d, ids(5)).unwrap();
    assert_eq!(small.search(&queries[..d], d, 50).unwrap()[0].len(), 5);
}

/// Build with `builder` on unnormalised vectors; recall@10 against exact search must be ≥ 0.98
/// and every score an exact inner product.
fn check_mips_recall(builder: HnswBuilder, base: &[f32], queries: &[f32], d: usize) -> HnswIndex {
    let (n, nq, k) = (base.len() / d, queries.len() / d, 10);
    let flat = FlatIndex::new(base.to_vec(), d, ids(n)).unwrap();
    let exact = flat.search(queries, d, k).unwrap();
    let params = HnswParams { m: 16, ef_construction: 200, ef_search: 128 };
    let hnsw = HnswIndex::build_with(base, d, ids(n), params, builder).unwrap();
    assert_eq!(hnsw.builder(), builder);
    let approx = hnsw.search(queries, d, k).unwrap();
    let mut found = 0;
    for (a, e) in approx.iter().zip(&exact) {
        let truth: std::collections::HashSet<usize> = e.iter().map(|h| h.row).collect();
        found += a.iter().filter(|h| truth.contains(&h.row)).count();
        // Scores are exact inner products, best first.
        for h in a {
            let x = &base[h.row * d..(h.row + 1) * d];
            let q = &queries[(approx.iter().position(|p| std::ptr::eq(p, a)).unwrap()) * d..][..d];
            let s: f32 = x.iter().zip(q).map(|(a, b)| a * b).sum();
            assert!((s - h.score).abs() < 1e-3 * s.abs().max(1.0));
        }
        assert!(a.windows(2).all(|w| w[0].score >= w[1].score));
    }
    let recall = found as f64 / (nq * k) as f64;
    eprintln!("HNSW ({builder}) MIPS recall@{k} = {recall:.4} (n={n}, d={d}, m=16, efC=200, ef=128)");
    assert!(recall >= 0.98, "{builder}: recall@{k} = {recall}");
    hnsw
}

#[test]
fn hnsw_rs_builder_mips_recall() {
    let d = 64;
    let hnsw = check_mips_recall(HnswBuilder::HnswRs, &vectors(20_000, d, 3), &vectors(200, d, 4), d);
    eprintln!("hnsw_rs cross-layer links dropped: {}", index::DROPPED_LINKS.load(Ordering::Relaxed));
    // The builder is recorded in index.json and survives a reload.
    let dir = tmpdir("hnsw-rs").join("idx");
    hnsw.save(&dir).unwrap();
    assert_eq!(index::info(&dir).unwrap()["params"]["builder"], "hnsw_rs");
    assert_eq!(HnswIndex::load(&dir).unwrap().builder(), HnswBuilder::HnswRs);
}

#[test]
fn hnsw_with_ef_above_n_scores_every_vector_once() {
    // ef ≥ n: the beam never fills, so layer 0 is walked to the end and every row but the
    // entry is scored there exactly once; the greedy descent adds at most one score per row.
    // Unit vectors, so that every row is reachable (with varying norms, short vectors can
    // lose all their in-links, as in any inner-product graph).
    let (n, d) = (300, 16);
    let mut base = vectors(n, d, 11);
    for row in base.chunks_mut(d) {
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        row.iter_mut().for_each(|x| *x /= norm);
    }
    let mut h = HnswIndex::build(&base, d, ids(n), HnswParams { m: 6, ef_construction: 32, ef_search: 16 }).unwrap();
    h.set_ef_search(n).unwrap();
    let queries = vectors(5, d, 12);
    let (hits, stats) = h.search_with_stats(&queries, d, n).unwrap();
    assert!(hits.iter().all(|h| h.len() == n), "every row is found");
    assert!(stats.distances >= 5 * (n - 1) && stats.distances < 5 * 2 * n, "{}", stats.distances);
}

#[test]
fn hnsw_native_builder_is_reproducible_on_one_thread() {
    let d = 32;
    let base = vectors(3_000, d, 7);
    let p = HnswParams { m: 8, ef_construction: 64, ef_search: 64 };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let build = || pool.install(|| HnswIndex::build(&base, d, ids(3_000), p).unwrap());
    let (a, b) = (tmpdir("repro-a").join("idx"), tmpdir("repro-b").join("idx"));
    build().save(&a).unwrap();
    build().save(&b).unwrap();
    assert_eq!(std::fs::read(a.join("graph.bin")).unwrap(), std::fs::read(b.join("graph.bin")).unwrap());
}

#[test]
fn hnsw_mips_recall_and_persistence() {
    let (n, d, k) = (20_000, 64, 10);
    let queries = vectors(200, d, 4);
    let hnsw = check_mips_recall(HnswBuilder::Native, &vectors(n, d, 3), &queries, d);
    let approx = hnsw.search(&queries, d, k).unwrap();
    // The counting search returns the same hits; ef = 128 means at least 128 vectors scored
    // per query, and a walk never scores a vector twice per layer pass (< 2n).
    let (counted, stats) = hnsw.search_with_stats(&queries, d, k).unwrap();
    assert_eq!(counted, approx);
    assert_eq!(stats.queries, 200);
    let per_query = stats.distances as f64 / 200.0;
    assert!((128.0..(2 * n) as f64).contains(&per_query), "{per_query} distances per query");

    // save → load → identical results; open() finds the kind; info() is index.json.
    let dir = tmpdir("hnsw").join("idx");
    hnsw.save(&dir).unwrap();
    let again = HnswIndex::load(&dir).unwrap();
    assert_eq!(again.search(&queries, d, k).unwrap(), approx);
    assert_eq!(again.ids(), hnsw.ids());
    let info = index::info(&dir).unwrap();
    assert_eq!(info["kind"], "hnsw");
    assert_eq!(info["dim"], 64);
    assert_eq!(info["count"], n);
    assert_eq!(info["metric"], "ip");
    assert_eq!(info["params"]["m"], 16);
    assert_eq!(info["params"]["builder"], "native");
    assert!(info["created_by"].as_str().unwrap().starts_with("rak-core "));
    match index::open(&dir).unwrap() {
        Index::Hnsw(h) => assert_eq!(h.len(), n),
        _ => panic!("wrong kind"),
    }
    // Saving over an existing index replaces it.
    hnsw.save(&dir).unwrap();

    // A damaged dump is an error, not a process exit.
    let graph = dir.join("graph.bin");
    let len = std::fs::metadata(&graph).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&graph).unwrap().set_len(len / 2).unwrap();
    let e = err(HnswIndex::load(&dir));
    assert!(e.contains("graph.bin") && e.contains("rebuild"), "{e}");
    // An out-of-range neighbour id is caught too (same length, one id corrupted).
    hnsw.save(&dir).unwrap();
    let mut b = std::fs::read(&graph).unwrap();
    let at = 8 + 8 + 4 + n + (n + 1) * 8; // first layer-0 neighbour
    b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&graph, b).unwrap();
    let e = err(HnswIndex::load(&dir));
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn flat_save_load_identical() {
    let (n, d) = (500, 16);
    let base = vectors(n, d, 5);
    let q = vectors(7, d, 6);
    let flat = FlatIndex::new(base, d, ids(n)).unwrap();
    let dir = tmpdir("flat").join("idx");
    flat.save(&dir).unwrap();
    let loaded = FlatIndex::load(&dir).unwrap();
    assert_eq!(loaded.search(&q, d, 10).unwrap(), flat.search(&q, d, 10).unwrap());
    assert_eq!(loaded.ids()[3], "doc3");
    let Index::Flat(_) = index::open(&dir).unwrap() else { panic!("wrong kind") };
    assert_eq!(index::info(&dir).unwrap()["kind"], "flat");
    // No temporary siblings left behind.
    let left: Vec<_> = std::fs::read_dir(dir.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn bm25_ranks_obvious_document_first_and_survives_weird_queries() {
    let corpus = vec![
        ("d1", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose and oxygen."),
        ("d2", "Volcano", "A volcano is a rupture in the crust of a planet where lava escapes."),
        ("d3", "Football", "Association football is a team sport played with a spherical ball."),
        ("d4", "Rust (programming language)", "Rust is a language emphasizing memory safety without a garbage collector."),
    ];
    let dir = tmpdir("bm25").join("idx");
    let bm = Bm25Index::build(&dir, corpus.clone(), Default::default()).unwrap();
    let hits = bm.search("how do plants use sunlight to make glucose", 3).unwrap();
    assert_eq!(hits[0].0, "d1", "{hits:?}");
    assert!(hits.windows(2).all(|w| w[0].1 >= w[1].1));
    assert_eq!(bm.search("lava volcano", 1).unwrap()[0].0, "d2");
    // Title counts.
    assert_eq!(bm.search("programming", 1).unwrap()[0].0, "d4");
    for q in ["\"unbalanced quote", "title:volcano", "(lava OR", "AND", "-", "+", "a:b:c", "***", "", "   ", "\\", "text:[a TO", "ñandú ☃ 火山", "NOT football^2~", "{}"] {
        let r = bm.search(q, 5);
        assert!(r.is_ok(), "query {q:?}: {:?}", r.err());
    }
    assert_eq!(bm.search("title:volcano", 1).unwrap()[0].0, "d2");
    let reopened = Bm25Index::open(&dir).unwrap();
    assert_eq!(reopened.search("football ball", 2).unwrap(), bm.search("football ball", 2).unwrap());
    let Index::Bm25(b) = index::open(&dir).unwrap() else { panic!("wrong kind") };
    assert_eq!(b.len(), 4);
    assert!(err(bm.search("x", 0)).contains("k must be"));
    let e = err(Bm25Index::build(&tmpdir("bm25e").join("idx"), Vec::<(String, String, String)>::new(), Default::default()));
    assert!(e.contains("empty corpus"), "{e}");
}

#[test]
fn bm25_scores_follow_lucene_formula_with_settable_constants() {
    // Analysed (title + text, stop words out): d1 [cat cat dog], d2 [dog dog dog mat], d3 [mat mat].
    let corpus = [("d1", "Cat", "cat dog"), ("d2", "Dog", "dog dog mat"), ("d3", "Mat", "the mat")];
    let dir = tmpdir("bm25formula").join("idx");
    let mut bm = Bm25Index::build(&dir, corpus, Default::default()).unwrap();
    assert_eq!(bm.params(), Bm25Params { k1: 0.9, b: 0.4 }, "Pyserini's defaults");
    let (n, avgdl) = (3.0f64, 3.0f64);
    let idf = |df: f64| (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
    let term = |p: Bm25Params, tf: f64, dl: f64, df: f64| idf(df) * tf / (tf + p.k1 as f64 * (1.0 - p.b as f64 + p.b as f64 * dl / avgdl));
    for p in [Bm25Params::default(), Bm25Params { k1: 1.2, b: 0.75 }, Bm25Params { k1: 2.0, b: 0.0 }] {
        bm.set_params(p).unwrap();
        // "Cats" stems to cat and counts twice, as Lucene sums repeated clauses; "the" is a stop word.
        let hits = bm.search("the cat Cats mat", 3).unwrap();
        let expect = [("d1", 2.0 * term(p, 2.0, 3.0, 1.0)), ("d3", term(p, 2.0, 2.0, 2.0)), ("d2", term(p, 1.0, 4.0, 2.0))];
        let mut expect = expect.to_vec();
        expect.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        assert_eq!(hits.len(), 3);
        for ((id, score), (eid, escore)) in hits.iter().zip(&expect) {
            assert_eq!(id, eid, "{p:?}: {hits:?} vs {expect:?}");
            assert!((*score as f64 - escore).abs() < 1e-5, "{p:?} {id}: {score} vs {escore}");
        }
    }
    assert!(bm.set_params(Bm25Params { k1: -1.0, b: 0.4 }).is_err());
    assert!(bm.set_params(Bm25Params { k1: 0.9, b: 1.5 }).is_err());
    // The constants an index was built with are the ones it opens with.
    let dir2 = tmpdir("bm25formula2").join("idx");
    Bm25Index::build(&dir2, corpus, Bm25Params { k1: 1.5, b: 0.2 }).unwrap();
    assert_eq!(Bm25Index::open(&dir2).unwrap().params(), Bm25Params { k1: 1.5, b: 0.2 });
}

#[test]
fn npy_round_trip_resume_and_ids() {
    let dir = tmpdir("npy");
    let p = dir.join("emb.npy");
    let data: Vec<f32> = (0..30).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut w = NpyWriter::create(&p, 3).unwrap();
    w.append(&data[..12]).unwrap();
    assert!(!p.exists(), "visible before finish");
    w.append(&data[12..]).unwrap();
    w.finish().unwrap();
    let a = NpyF32::open(&p).unwrap();
    assert_eq!((a.rows(), a.dim()), (10, 3));
    assert_eq!(a.data(), &data[..]);
    assert_eq!(a.row(2), &data[6..9]);
    // The header is what numpy writes: version 1.0, '<f4', C order, 64-byte aligned.
    let bytes = std::fs::read(&p).unwrap();
    let hl = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!((10 + hl) % 64, 0);
    assert!(std::str::from_utf8(&bytes[10..10 + hl]).unwrap().contains("'shape': (10, 3)"));

    // Resume after a crash that tore the last row.
    let p2 = dir.join("resumed.npy");
    let mut w = NpyWriter::create(&p2, 3).unwrap();
    w.append(&data[..9]).unwrap();
    drop(w); // "crash": the partial file stays
    let partial = npy::partial_path(&p2);
    let mut f = std::fs::OpenOptions::new().append(true).open(&partial).unwrap();
    std::io::Write::write_all(&mut f, &[1, 2, 3, 4, 5]).unwrap(); // torn row
    drop(f);
    let mut w = NpyWriter::resume(&p2, 3).unwrap();
    assert_eq!(w.rows(), 3);
    w.append(&data[9..]).unwrap();
    w.finish().unwrap();
    assert_eq!(NpyF32::open(&p2).unwrap().data(), &data[..]);
    assert!(!partial.exists());
    assert!(err(NpyWriter::create(&p2, 3).and_then(|mut w| w.append(&[1.0, 2.0]))).contains("multiple of the row width"));

    let idp = dir.join("ids.txt");
    npy::write_ids(&idp, &["a", "b c", "d"]).unwrap();
    assert_eq!(npy::read_ids(&idp).unwrap(), vec!["a", "b c", "d"]);
    assert!(err(npy::write_ids(&idp, &["a", "b\nc"])).contains("line break"));
    std::fs::write(&idp, "a\n\nb\n").unwrap();
    assert!(err(npy::read_ids(&idp)).contains("line 2 is empty"));
}

fn npy_with_header(dict: &str, payload: usize) -> Vec<u8> {
    let mut h = dict.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(h.len() as u16).to_le_bytes());
    b.extend_from_slice(h.as_bytes());
    b.extend(std::iter::repeat_n(0u8, payload));
    b
}

#[test]
fn bad_npy_files_are_named_and_explained() {
    let dir = tmpdir("badnpy");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("magic.npy", b"PK\x03\x04 not numpy".to_vec(), "magic"),
        ("f8.npy", npy_with_header("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }", 32), "'<f4'"),
        ("fortran.npy", npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", 16), "Fortran"),
        ("3d.npy", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2, 2), }", 32), "2-D"),
        ("trunc.npy", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), }", 20), "truncated"),
        ("empty.npy", vec![], "magic"),
    ];
    for (name, bytes, want) in cases {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = err(NpyF32::open(&p));
        assert!(e.contains(name) && e.contains(want), "{name}: {e}");
    }
    // numpy's own header for a 1-column matrix reads fine.
    let p = dir.join("ok.npy");
    std::fs::write(&p, npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 1), }", 12)).unwrap();
    assert_eq!(NpyF32::open(&p).unwrap().rows(), 3);
}

#[test]
fn errors_are_clear_and_never_panic() {
    let d = 8;
    let base = vectors(100, d, 7);
    let flat = FlatIndex::new(base.clone(), d, ids(100)).unwrap();
    let q = vectors(2, 4, 8);
    let e = err(flat.search(&q, 4, 5));
    assert!(e.contains("dimension mismatch") && e.contains("8-d") && e.contains("4-d"), "{e}");
    assert!(err(flat.search(&base[..d], d, 0)).contains("k must be"));
    assert!(err(flat.search(&base[..d + 1], d, 1)).contains("whole number of rows"));
    assert!(flat.search(&[], d, 3).unwrap().is_empty());
    let e = err(FlatIndex::new(base.clone(), d, ids(99)));
    assert!(e.contains("99 ids for 100 embeddings"), "{e}");
    assert!(err(FlatIndex::new(vec![], d, vec![])).contains("empty embeddings"));
    assert!(err(FlatIndex::new(vec![1.0; 8], 0, ids(1))).contains("dimension is 0"));
    let mut nan = base.clone();
    nan[3 * d + 2] = f32::NAN;
    assert!(err(FlatIndex::new(nan.clone(), d, ids(100))).contains("row 3 holds a non-finite"));
    // Finite values whose inner products could overflow f32 (inf - inf = NaN scores).
    let mut huge = base.clone();
    huge[5 * d..6 * d].fill(1e20);
    let e = err(FlatIndex::new(huge.clone(), d, ids(100)));
    assert!(e.contains("row 5") && e.contains("overflows"), "{e}");
    assert!(err(flat.search(&huge[5 * d..6 * d], d, 3)).contains("overflows"));

    let ok = HnswParams { m: 8, ef_construction: 32, ef_search: 16 };
    assert!(err(HnswIndex::build(&nan, d, ids(100), ok)).contains("non-finite"));
    assert!(err(HnswIndex::build(&[], d, vec![], ok)).contains("empty embeddings"));
    assert!(err(HnswIndex::build(&base, d, ids(3), ok)).contains("3 ids for 100"));
    for (p, want) in [
        (HnswParams { m: 0, ..ok }, "m = 0"),
        (HnswParams { m: 1, ..ok }, "m = 1"),
        (HnswParams { m: 300, ef_construction: 400, ..ok }, "m = 300"),
        (HnswParams { ef_construction: 4, ..ok }, "ef_construction = 4"),
        (HnswParams { ef_search: 0, ..ok }, "ef_search = 0"),
    ] {
        let e = err(HnswIndex::build(&base, d, ids(100), p));
        assert!(e.contains(want), "{p:?}: {e}");
    }
    assert!(err(HnswIndex::build(&huge, d, ids(100), ok)).contains("overflows"));
    let mut h = HnswIndex::build(&base, d, ids(100), ok).unwrap();
    assert!(h.search(&[], d, 3).unwrap().is_empty());
    let e = err(h.search(&q, 4, 5));
    assert!(e.contains("8-d") && e.contains("4-d"), "{e}");
    assert!(err(h.set_ef_search(0)).contains("ef_search"));
    h.set_ef_search(64).unwrap();
    // A one-vector index works with either builder (hnsw_rs special-cases the first point).
    for b in [HnswBuilder::Native, HnswBuilder::HnswRs] {
        let one = HnswIndex::build_with(&base[..d], d, ids(1), ok, b).unwrap();
        assert_eq!(one.search(&base[..d], d, 3).unwrap()[0].len(), 1);
    }
    assert!(err("faiss".parse::<HnswBuilder>()).contains("expected native or hnsw_rs"));

    // Loading from a non-index directory or of the wrong kind.
    let nowhere = tmpdir("none");
    assert!(err(index::open(&nowhere)).contains("index.json"));
    let dir = tmpdir("kind").join("idx");
    flat.save(&dir).unwrap();
    assert!(err(HnswIndex::load(&dir)).contains("is a flat index, not hnsw"));
    std::fs::write(dir.join("ids.txt"), "a\nb\n").unwrap();
    assert!(err(FlatIndex::load(&dir)).contains("2 ids for 100"));
}
