"""Memory layout (SmartMem, ASPLOS'24): layout-transformation elimination, the
reduction-dimension layout choice, and texture (image2d) layouts for Adreno OpenCL.

* :mod:`.smartmem`: ``EliminateLayoutTransforms`` and its parts (classes, index maps, choice);
* :mod:`.texture`: ``AnnotateTextureScopes``, ``ScheduleTextureKernels`` and the TIR lowering
  that writes whole texels (``tir_pipeline="tvm_fusion_adreno"``);
* :mod:`.opencl_runner`: runs the generated kernels on PoCL through pyopencl (tests);
* :mod:`.pipeline`: where these passes sit in a build; :mod:`.measure`: the documented numbers.

See ``docs/smartmem.md``.
"""
