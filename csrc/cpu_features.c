// pagedllm._C_cpu_features: the instruction sets of the running CPU (and OS) that pagedllm builds kernel
// variants for. A plain C module without torch, built beside the variants, so that the Python side can pick
// the best built variant without importing one it cannot run: a build may hold only the variant for the
// machine that built it (scripts/setup.sh's first command). Empty where none applies (not x86).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *cpu_features(PyObject *self, PyObject *unused) {
  PyObject *found = PyList_New(0);
  if (found == NULL) return NULL;
#if defined(__x86_64__) || defined(__i386__)
  static const char *const names[] = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                                      "avx512dq", "avx512cd", "avx512bf16", "avx512vnni"};
  // __builtin_cpu_supports takes only string literals, so each check is spelled out in the same order.
  const int supported[] = {
      __builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"), __builtin_cpu_supports("f16c"),
      __builtin_cpu_supports("bmi2"), __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"),
      __builtin_cpu_supports("avx512vl"), __builtin_cpu_supports("avx512dq"), __builtin_cpu_supports("avx512cd"),
      __builtin_cpu_supports("avx512bf16"), __builtin_cpu_supports("avx512vnni")};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
    if (!supported[i]) continue;
    PyObject *name = PyUnicode_FromString(names[i]);
    if (name == NULL || PyList_Append(found, name) < 0) {
      Py_XDECREF(name);
      Py_DECREF(found);
      return NULL;
    }
    Py_DECREF(name);
  }
#endif
  return found;
}

static PyMethodDef methods[] = {
    {"cpu_features", cpu_features, METH_NOARGS, "Instruction sets of this CPU that kernel variants need"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cpu_features", NULL, 0, methods};

PyMODINIT_FUNC PyInit__C_cpu_features(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#endif
  return PyModule_Create(&module);
}
