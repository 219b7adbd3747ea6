"""The sparse MLA attention kernels, by role.

Read a kernel from its builder down: ``sparse_decode.build_sparse_decode`` checks the knobs and
picks a schedule body, which composes the roles below inside the one signature.

=====================  ====================================================================
``signature``          the decode prim_func's parameters, written once
``work``               a row's lengths and tiles; the persistent grid's plan and walk
``ring``               shared-memory rings and barriers; the named-barrier ids
``softmax``            the online softmax (heads in M; tokens in M)
``consume``            the consumer warpgroups: split pair, seesaw pair, tokens-in-M P·V
``epilogue``           output-half stores, the split table the combine reads
``produce_fp8``        the FP8 producer warpgroup of every Hopper decode
``produce_bf16``       prefill's BF16 gather
``rules``              knob rules read by the builders, the tuner and the front end
``decode_ws``          64-head Hopper decode (fixed or persistent grid)
``decode_seesaw``      64-head Hopper decode on the seesaw consumers
``decode_tim``         8-32-head Hopper decode (tokens in M)
``decode_plan``        the persistent grid's plan alone: the metadata kernel (``plan_only``)
``sparse_decode``      the decode builder and its portable body
``sparse_decode_combine``  the split-KV combine
``sparse_prefill``     the prefill builder and its bodies
=====================  ====================================================================

Nothing here imports upward: a role module imports only roles above it in this table and
the parent package's ``layout``, ``fp8``, ``tile_math`` and ``compile_options``
(``tests/builds/test_import_graph.py``).

A shared piece keeps the kernels' TIR only when written as a ``T.macro`` whose scalar
parameters carry the callers' variable names: TileLang binds each scalar argument to its
parameter's name (an expression argument becomes a let-variable; a variable argument is
renamed), and an ``alloc_var`` argument must be passed by reference (``r_b: T.Ref``), which a
let-variable cannot be. A plain Python helper that returns expressions inlines them where the
kernel bound names. ``scripts/kernel_fingerprints.py --check --no-lower`` (seconds) says
whether a change kept every shipped variant's TIR.
"""
