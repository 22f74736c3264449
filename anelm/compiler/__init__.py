"""The compiler: a Graph (anelm.ir) in, an Artifact (MIL text + BLOBFILE weights + signature)
out, under a chip profile.

    registry.py   passes by name; passes/ the passes themselves (cleanup, decompose, layout,
                  validate with the SRAM estimate, the cost annotation)
    pipeline.py   the ordered pass list and `compile_graph`
    codegen.py    lowering to the MIL program model (anelm.mil)
    artifact.py   the kernel folder: save, load, signature
    verify.py     graph invariants between passes (ANELM_DEBUG)

It imports only mil, ir and chip: nothing model-specific, never the device or the runtime.
"""
