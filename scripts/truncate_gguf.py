#!/usr/bin/env python3
"""Writes a copy of a Llama-family GGUF keeping only its first N blocks (real weights, fewer
layers): small enough to carry to a machine that cannot fetch the full model.

usage: truncate_gguf.py IN.gguf OUT.gguf N
"""
import sys

import gguf
import numpy as np


def main():
    src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if name == f"{arch}.block_count":
            w.add_uint32(name, keep)
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[-1]).decode("utf-8", errors="surrogateescape"), vtype)
        else:
            w.add_key_value(name, field.parts[-1].tolist()[0], vtype)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= keep:
            continue
        data = np.asarray(t.data)
        # Quantized data comes as bytes [rows, row_bytes]; the writer derives the shape from it.
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
