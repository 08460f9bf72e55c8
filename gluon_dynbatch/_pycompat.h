/* The few C API functions of newer Pythons that the extensions use, for
 * the Pythons setup.py accepts (3.8, 3.9): they compiled there with
 * warnings and then failed to import (undefined symbol Py_NewRef), and
 * gluon_dynbatch quietly ran in pure Python. */
#ifndef GLUON_DYNBATCH_PYCOMPAT_H
#define GLUON_DYNBATCH_PYCOMPAT_H

#if PY_VERSION_HEX < 0x03090000
#define Py_IS_TYPE(ob, type) (Py_TYPE(ob) == (type))
static inline PyObject *PyObject_CallNoArgs(PyObject *func)
{
    return PyObject_CallObject(func, NULL);
}
static inline PyObject *PyObject_CallOneArg(PyObject *func, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(func, arg, NULL);
}
static inline PyObject *PyObject_CallMethodNoArgs(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodObjArgs(obj, name, NULL);
}
static inline uint64_t PyThreadState_GetID(PyThreadState *tstate)
{
    return tstate->id;
}
#endif

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *obj)
{
    Py_INCREF(obj);
    return obj;
}
static inline PyObject *Py_XNewRef(PyObject *obj)
{
    Py_XINCREF(obj);
    return obj;
}
static inline int PyModule_AddObjectRef(PyObject *module, const char *name, PyObject *value)
{
    Py_XINCREF(value);
    if (PyModule_AddObject(module, name, value) < 0) {
        Py_XDECREF(value);
        return -1;
    }
    return 0;
}
#endif

#endif
