"""Helpers for the tests of lmforge._core's argument checks: arrays that claim to live on a GPU."""

from __future__ import annotations

import ctypes

import numpy as np

KDL_CUDA = 2  # DLPack's device type of CUDA memory
_NAME = b"dltensor"  # the capsule's name must outlive it: a module constant


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_keep: list[object] = []  # what the capsules point into lives as long as the test process


def cuda_labelled(a: np.ndarray) -> object:
    """A DLPack capsule of the C-contiguous array ``a``'s host memory that says it is CUDA device 0's: an argument
    a CPU kernel must refuse (reading it would dereference a device pointer on the host). One use per capsule."""
    a = np.ascontiguousarray(a)
    code = {"f": 2, "i": 0, "u": 1}[a.dtype.kind]
    shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
    m = _Managed()
    m.dl_tensor = _Tensor(a.ctypes.data, _Device(KDL_CUDA, 0), a.ndim, _DType(code, 8 * a.itemsize, 1), shape,
                          None, 0)
    _keep.extend((a, shape, m))
    return _capsule_new(ctypes.addressof(m), _NAME, None)
